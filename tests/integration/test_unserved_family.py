"""An encoder of a family the engines do not serve, end to end: the orchestrator
starts a real worker process for it, the worker exits 78 with one line naming the
family and why, the orchestrator marks the model `failed` with that line and never
starts it again, and the gateway's model card and its requests say the same.

nomic-bert is the case: its modelling code lives only on the hub (trust_remote_code),
so there is no independent reference to check an implementation against offline.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import sys
import time

from services.orchestrator.service import Orchestrator
from shared import catalog, subjects
from shared.config import EX_CONFIG, Config
from shared.messages import fleet_status_decoder
from tests.integration.test_cold_start import ask, body, cards
from tests.support.stack import running_stack, wait_until

MODEL = "nomic-embed"
NOMIC = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"],
         "auto_map": {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
         "n_embd": 768, "n_head": 12, "n_layer": 12, "rotary_emb_fraction": 1.0}  # fmt: skip


def _nomic_dir(d):
    """A nomic-embed-text-style directory: its config, sentence-transformers modules
    and a BERT tokenizer (weights are never read: the refusal comes first)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(NOMIC))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        src = catalog.bundled_dir(catalog.ENCODER) / name
        if src.exists():
            shutil.copy(src, d / name)
    return d


async def test_an_unserved_encoder_family_fails_with_the_reason_and_is_not_restarted(
        nats_server, nc, tmp_path):
    d = _nomic_dir(tmp_path / "nomic")
    assert catalog.describe(MODEL, d).kind == "encoder"  # never tried as a decoder
    config = Config.from_env({}, nats_url=nats_server.url, fleet=f"{MODEL}=1:1", local_workers=2)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "TENSORBUS_NATS_URL": nats_server.url,
           "TENSORBUS_MODEL_DIR": str(d), "TENSORBUS_DATA_DIR": str(tmp_path / "data"),
           "TENSORBUS_LOG_FORMAT": "json"}  # fmt: skip
    statuses, out = [], io.BytesIO()

    async def on_status(msg) -> None:
        statuses.append(fleet_status_decoder.decode(msg.data))

    def latest():
        for st in reversed(statuses):
            for m in st.models:
                if m.model == MODEL:
                    return m
        return None

    async def catalogue() -> list[str]:
        return [MODEL]

    sub = await nc.subscribe(subjects.ORCHESTRATOR_STATUS, cb=on_status)
    orch = Orchestrator(nc, config, catalogue, env=env, cores=2, interval_s=0.1, status_s=0.2,
                        worker_argv=[sys.executable, "-m", "services.worker"],
                        orchestrator_id="test", out=out)  # fmt: skip
    exits = []
    on_exit = orch.launcher.on_exit
    orch.launcher.on_exit = lambda wp, code: (exits.append(code), on_exit(wp, code))[1]
    async with running_stack(nats_server.url, models={MODEL: str(d)}, fleet=f"{MODEL}=1:1") as st:
        ready = asyncio.Event()
        task = asyncio.create_task(orch.run(ready))
        try:
            await wait_until(lambda: (m := latest()) is not None and m.state == "failed", timeout=120)
            reason = latest().reason
            assert reason.startswith(f"bad configuration: {MODEL}: architecture 'nomic-bert'")
            assert "trust_remote_code" in reason and "\n" not in reason, reason
            assert exits == [EX_CONFIG]
            assert reason.encode() in out.getvalue()  # the worker's own last line
            # Not restarted: five status rounds later it was still started once.
            n = len(statuses)
            await wait_until(lambda: len(statuses) > n + 5, timeout=20)
            assert orch.launcher._seq.get(MODEL) == 1 and latest().state == "failed"
            # The gateway: the card says failed with the reason; requests get 503 with it.
            await wait_until(lambda: MODEL in st.gateway.front.statuses, timeout=10)
            card = (await cards(st.client))[MODEL]
            assert (card["state"], card["reason"], card["ready_workers"]) == ("failed", reason, 0)
            t0 = time.monotonic()
            code, resp = await ask(st.client, body(model=MODEL), timeout=5)
            assert code == 503 and reason in resp["error"]["message"]
            assert time.monotonic() - t0 < 1
        finally:
            orch.stop()
            await asyncio.wait_for(task, 15)
            await sub.unsubscribe()
