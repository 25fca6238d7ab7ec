"""The whole stack on the shipped secured configs: every service, the CLI and the
client log in as their own role through TENSORBUS_NATS_* settings alone.

Real processes (services/supervisor.py) against deploy/nats/auth-nkeys.conf (each
role signs the server's nonce with its own seed) and deploy/nats/tls-mtls.conf (each
role presents the client certificate and its password); an embeddings request goes
client -> gateway -> scheduler -> worker and back. The deploy role creates the
registry's buckets with `tensorbus registry list`, as the seed Job does.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import msgspec
import pytest

from services.gateway.frontend import INLINE_TOKENIZE
from services.supervisor import REPO, Supervisor, wait_ready
from shared import catalog, subjects
from shared.api_batches import PURPOSE_HEADER
from shared.bus import close, open_client
from shared.config import Config
from shared.errors import HEADER_CODE
from shared.natsd import free_port
from shared.roles import REFUSED, covers
from tests.security.conftest import NATS_DIR, make_passwords, pass_var, start_server
from tests.security.test_nats_nkeys_tls import make_nkeys

ENCODER = catalog.ENCODER
SERVICES = (("scheduler", "services.scheduler"), ("worker", "services.worker"),
            ("telemetry", "services.telemetry"), ("gateway", "services.gateway"))


class Login:
    """What each role's environment holds in one secured set-up."""

    def __init__(self, mode: str, port: int, passwords: dict, nkeys_dir, tls_dir) -> None:
        self.mode, self.port = mode, port
        self.passwords, self.nkeys_dir, self.tls_dir = passwords, nkeys_dir, tls_dir

    def env(self, role: str) -> dict[str, str]:
        if self.mode == "nkeys":
            return {"TENSORBUS_NATS_URL": f"nats://127.0.0.1:{self.port}",
                    "TENSORBUS_NATS_NKEY_SEED": str(self.nkeys_dir / f"{role}.nk")}
        return {"TENSORBUS_NATS_URL": f"tls://{role}:{self.passwords[role]}@127.0.0.1:{self.port}",
                "TENSORBUS_NATS_TLS_CA": str(self.tls_dir / "ca.crt"),
                "TENSORBUS_NATS_TLS_CERT": str(self.tls_dir / "client.crt"),
                "TENSORBUS_NATS_TLS_KEY": str(self.tls_dir / "client.key")}


def server_env(passwords, nkeys_dir, tls_dir) -> dict[str, str]:
    env = {pass_var(r): p for r, p in passwords.items()}
    for line in (nkeys_dir / "server.env").read_text().split():
        k, v = line.split("=", 1)
        env[k] = v
    return env | {"TENSORBUS_NATS_SERVER_TLS_CERT": str(tls_dir / "server.crt"),
                  "TENSORBUS_NATS_SERVER_TLS_KEY": str(tls_dir / "server.key"),
                  "TENSORBUS_NATS_SERVER_TLS_CA": str(tls_dir / "ca.crt")}


def cli(login: Login, role: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ) | {"HF_HUB_OFFLINE": "1"} | login.env(role)
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


async def exercise(client) -> None:
    """Every endpoint an encoder serves, and the paths behind them: tokenize and
    detokenize (gateway only), the model list, a body large enough to be reserved
    at a scheduler before it is tokenized (`sched.reserve`, then the reserving
    scheduler's own submit subject), and a file put and listed. Each answer must be
    a success."""
    async def ok(subject: str, req: dict, headers=None, raw: bytes | None = None) -> dict:
        data = msgspec.json.encode(req) if raw is None else raw
        msg = await client.request(subject, data, timeout=30, headers=headers)
        assert (msg.headers or {}).get(HEADER_CODE) is None, (subject, msg.data[:500])
        return msgspec.json.decode(msg.data)

    ids = (await ok(subjects.TOKENIZE, {"model": ENCODER, "prompt": "signed in"}))["tokens"]
    assert (await ok(subjects.DETOKENIZE, {"model": ENCODER, "tokens": ids}))["prompt"]
    assert ENCODER in {m["id"] for m in (await ok(subjects.MODELS, {}))["data"]}
    large = "signed in" + " " * (INLINE_TOKENIZE + 100)
    body = await ok(subjects.EMBEDDINGS, {"model": ENCODER, "input": [large]})
    assert len(body["data"][0]["embedding"]) == 384
    # The Files and Batch API: the CLIENTS account's import of the gateway's subjects,
    # and the gateway's own rights on the files and batches buckets.
    f = await ok(subjects.files("put"), {}, {PURPOSE_HEADER: "batch"}, b"{}\n")
    assert f["id"] in {x["id"] for x in (await ok(subjects.files("list"), {}))["data"]}
    assert (await ok(subjects.batches("list"), {}))["object"] == "list"


VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


def refused_on_purpose(role: str, subject: str) -> bool:
    return any(covers(p.lower(), subject.lower()) for p, _ in REFUSED.get(role, ()))


def unexpected_refusals(role: str, log: str) -> list[str]:
    """A service's logged permissions violations that shared.roles does not expect."""
    return [f"{op} {subj}" for op, subj in VIOLATION.findall(log.lower())
            if op == "subscription" or not refused_on_purpose(role, subj)]


def server_refusals(log: str) -> list[str]:
    """nats-server's own violation lines, less the publishes some role is refused
    on purpose (its log names the user, an nkey or a name, so match any role)."""
    out = []
    for line in log.splitlines():
        if "violation" not in line.lower() or "authorization violation" in line.lower():
            continue
        subj = re.search(r'Subject "([^"]+)"', line)
        if "Publish Violation" in line and subj and any(
                refused_on_purpose(r, subj.group(1)) for r in REFUSED):
            continue
        out.append(line)
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    nkeys_dir = tmp_path_factory.mktemp("nkeys")
    make_nkeys.write_keys(nkeys_dir)
    tls_dir = tmp_path_factory.mktemp("tls")
    subprocess.run([str(NATS_DIR / "make-dev-ca.sh"), str(tls_dir)], check=True,
                   capture_output=True)
    return make_passwords(), nkeys_dir, tls_dir


@pytest.mark.parametrize("mode,conf", [("nkeys", "auth-nkeys.conf"), ("mtls", "tls-mtls.conf")])
async def test_every_service_logs_in_as_its_role_and_serves(tmp_path, keys, mode, conf):
    passwords, nkeys_dir, tls_dir = keys
    with Supervisor(tmp_path, env={"TENSORBUS_HTTP_PORT": str(free_port()),
                                   "TENSORBUS_METRICS_PORT": str(free_port()),
                                   "TENSORBUS_BATCH_BUCKETS": "1", "TENSORBUS_SEQ_BUCKETS": "16",
                                   "TENSORBUS_MAX_BATCH": "1",
                                   "TENSORBUS_FLEET": f"{ENCODER}=1:1"}) as sup:
        server_log = tmp_path / "nats-server.log"
        sup.nats = start_server(tmp_path / "js", NATS_DIR / conf,
                                server_env(passwords, nkeys_dir, tls_dir), log=server_log)
        login = Login(mode, sup.nats.port, passwords, nkeys_dir, tls_dir)

        # The deploy role makes the registry's buckets (no other role may).
        res = cli(login, "deploy", "registry", "list")
        assert res.returncode == 0, res.stderr[-2000:]

        for role, module in SERVICES:
            extra = {"TENSORBUS_MODEL_DIR": str(catalog.bundled_dir(ENCODER)),
                     "TENSORBUS_WORKER_ID": "w-secured"} if role == "worker" else {}
            sup.start(role, module, **login.env(role), **extra)

        client = await open_client(login.env("client")["TENSORBUS_NATS_URL"],
                                   Config.from_env(login.env("client")),
                                   allow_reconnect=False, connect_timeout=3)
        try:
            await wait_ready(client, ENCODER, timeout=240)
            msg = await client.request(subjects.EMBEDDINGS, msgspec.json.encode(
                {"model": ENCODER, "input": ["signed in"]}), timeout=30)
            assert (msg.headers or {}).get(HEADER_CODE) is None, msg.data[:500]
            body = msgspec.json.decode(msg.data)
            assert len(body["data"][0]["embedding"]) == 384
            await exercise(client)
        finally:
            await close(client)

        # The CLI, as the client role, over the same credentials.
        res = await asyncio.to_thread(cli, login, "client", "embed", "from the cli",
                                      "--model", ENCODER)
        assert res.returncode == 0, res.stdout[-1000:] + res.stderr[-2000:]
        assert len(msgspec.json.decode(res.stdout)["data"][0]["embedding"]) == 384

        for name, proc in sup.procs.items():
            assert proc.alive(), f"{name} exited:\n{proc.log_path.read_text()[-3000:]}"
            log = proc.log_path.read_text().lower()
            assert "authorization violation" not in log, f"{name}:\n{log[-3000:]}"
            assert unexpected_refusals(name, log) == [], f"{name}:\n{log[-3000:]}"
        assert server_refusals(server_log.read_text()) == []

        # docs/security.md: under the secured roles telemetry has no registry rights,
        # says so, and serves on without the automatic canary rollback.
        telemetry = sup.procs["telemetry"].log_path
        end = time.monotonic() + 20
        while "registry_unavailable" not in telemetry.read_text():
            assert time.monotonic() < end, telemetry.read_text()[-3000:]
            await asyncio.sleep(0.1)  # polling the log file for the line to land
        assert "no automatic canary rollback" in telemetry.read_text()
        assert sup.procs["telemetry"].alive()


def test_a_seed_that_is_not_one_exits_78(tmp_path):
    bad = tmp_path / "bad.nk"
    bad.write_text("SUNOTASEED\n")
    res = subprocess.run([sys.executable, "-m", "services.telemetry"], cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "TENSORBUS_NATS_NKEY_SEED": str(bad),
                              "TENSORBUS_NATS_URL": f"nats://127.0.0.1:{free_port()}"},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 78, res.stderr[-2000:]
    assert "nkey seed" in res.stderr
