"""The decoder runner and a quantized engine with a cold compute-forms file: the
first request is served before any form is measured; the runner measures them when
it is idle (woken by the engine's background compiles), the choice is stored, and
later requests are served in the chosen forms with the same greedy text. Counted on
the engine's own calls."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

from engine import forms
from engine.decoder import DecoderEngine
from engine.decoder.static import generate_static
from engine.detok import Detokenizer
from services.worker.generation import DecoderRunner
from services.worker.versions import LoadedModels
from shared.catalog import DEMO_LM, bundled_dir
from shared.messages import GenerateWork, Sampling
from tests.services.test_worker_runner import Recorder
from tests.support.stack import wait_until

_DEMO = dict(slots=2, max_context=64, prefill_buckets=(16, 32), decode_windows=(64,),
             quant="int4", weight_budget=10**9)  # float and dequant: the same function
PROMPT = list(range(30, 42))


class Calls:
    """Wraps an engine; records the order of its prompt chunks and measurements."""

    def __init__(self, engine: DecoderEngine) -> None:
        self.engine = engine
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False):
        self.calls.append("prefill")
        return self.engine.prefill_step(slot, budget, mix)

    def tune(self, limit: int = 1) -> int:
        self.calls.append(f"measure {self.engine.forms.measurements}")
        return self.engine.tune(limit)


def _work(rid: str) -> GenerateWork:
    return GenerateWork(rid, DEMO_LM, "", PROMPT, 12, Sampling(temperature=0), [], 1, True,
                        time.time() + 600, f"reply.{rid}", "sched", ignore_eos=True)


async def test_the_runner_serves_first_then_measures_the_forms_when_idle(tmp_path):
    path = tmp_path / forms.CACHE_NAME
    engine = DecoderEngine(bundled_dir(DEMO_LM), DEMO_LM, forms_cache=path,
                           compile_ahead="first", **_DEMO)  # fmt: skip
    engine.warmup(progress=False)
    assert (engine.forms.measurements, engine.forms.units) == (0, 8)  # 4 buckets x 2 forms, none measured at ready
    calls = Calls(engine)
    out = Recorder()
    runner = DecoderRunner(LoadedModels(calls, "1", kind="decoder"), out, ThreadPoolExecutor(1),
                           prefill_per_step=8, prefill_chunk=32)  # fmt: skip
    runner.submit(_work("r0"))  # waiting when the loop starts, as a held first request
    task = asyncio.create_task(runner.run())
    try:
        await wait_until(lambda: out.finished == ["r0"], timeout=300)
        await wait_until(lambda: engine.forms.settled, timeout=600)
        assert calls.calls[0] == "prefill" and "measure 0" in calls.calls
        assert (engine.forms.measurements, engine.forms.units) == (8, 8) and engine.forms.measured
        (entry,) = json.loads(path.read_text()).values()
        assert entry["choices"] == engine.forms.compute_forms
        runner.submit(_work("r1"))  # served in the chosen forms
        await wait_until(lambda: out.finished == ["r0", "r1"], timeout=300)
    finally:
        task.cancel()
    assert out.errors == []
    ref = DecoderEngine(bundled_dir(DEMO_LM), DEMO_LM, forms_cache=None,
                        **{**_DEMO, "quant_form": "dequant"})  # fmt: skip
    (tokens,) = generate_static(ref, [PROMPT], 12)
    detok = Detokenizer(ref.tokenizer, prompt_ids=PROMPT, stop=[])
    want = "".join(detok.feed(t) for t in tokens) + detok.flush()
    assert out.texts("r0")[0][0] == want and out.texts("r1")[0][0] == want
