"""The decoder runner over a speculating engine (the tiny Llama, TENSORBUS_SPECULATIVE
=ngram:4): a step that emits several tokens of one stream still ends it exactly at
max_tokens or at a stop token inside the accepted run, two streams side by side
(normal steps) and then one alone (speculating again) keep their text, and the
runner's gauges count the drafts accepted."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.decoder import DecoderEngine
from engine.detok import Detokenizer
from services.worker.generation import DecoderRunner
from services.worker.versions import LoadedModels
from shared.messages import GenDone, GenerateWork, Sampling
from tests.services.test_worker_runner import Recorder
from tests.support.stack import wait_until
from tests.support.tiny_models import build, hf_greedy

REPEATING = [5, 17, 300, 42, 9, 11] * 4
OTHER = list(range(40, 49))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-spec-runner")
    return out, build("llama", out, positions=128)


def _work(rid: str, prompt: list[int], max_tokens: int, stop_ids=()) -> GenerateWork:
    sampling = Sampling(temperature=0, stop_token_ids=list(stop_ids))
    return GenerateWork(rid, "tiny", "", prompt, max_tokens, sampling, [], 1, True,
                        time.time() + 120, f"reply.{rid}", "sched", ignore_eos=True)


def _text(engine, prompt: list[int], tokens: list[int]) -> str:
    detok = Detokenizer(engine.tokenizer, prompt_ids=prompt, stop=[])
    return "".join(detok.feed(t) for t in tokens) + detok.flush()


def _done(out: Recorder, rid: str) -> GenDone:
    return next(m for m in out.messages if isinstance(m, GenDone) and m.request_id == rid)


async def test_speculating_runner_keeps_every_text_and_counts_acceptance(tiny):
    path, ref = tiny
    engine = DecoderEngine(path, "tiny", slots=4, max_context=96, prefill_buckets=(16, 32),
                           decode_windows=(32, 64), speculative=4)  # fmt: skip
    engine.warmup(progress=False)
    runner = DecoderRunner(LoadedModels(engine, "1", kind="decoder"), out := Recorder(),
                           ThreadPoolExecutor(1), prefill_per_step=8, prefill_chunk=32)
    task = asyncio.create_task(runner.run())
    greedy = hf_greedy(ref, REPEATING, 48)
    # A stop token first generated late, inside the repeating run drafts reach.
    at = next(i for i in range(20, 48) if greedy[i] not in greedy[:i])
    alone = [("full", 48, ()), ("cut", 23, ()), ("stop", 48, (greedy[at],))]
    try:
        for rid, n, stop in alone:  # one at a time: each speculates
            runner.submit(_work(rid, REPEATING, n, stop))
            await wait_until(lambda rid=rid: rid in out.finished, timeout=120)
        # Two side by side: normal steps; the longer speculates once the other ends.
        runner.submit(_work("pair-a", REPEATING, 40))
        runner.submit(_work("pair-b", OTHER, 12))
        await wait_until(lambda: {"pair-a", "pair-b"} <= set(out.finished), timeout=120)
        await wait_until(lambda: not runner.sched.busy, timeout=60)
        load = runner.gauges()
    finally:
        task.cancel()
    assert out.errors == []
    assert out.texts("full")[0][0] == _text(engine, REPEATING, greedy)
    assert out.texts("cut")[0][0] == _text(engine, REPEATING, greedy[:23])
    assert _done(out, "cut").completion_tokens == 23
    assert out.texts("stop")[0][0] == _text(engine, REPEATING, greedy[:at])
    assert _done(out, "stop").completion_tokens == at + 1  # the stop token counts, unsaid
    assert out.texts("pair-a")[0][0] == _text(engine, REPEATING, greedy[:40])
    assert out.texts("pair-b")[0][0] == _text(engine, OTHER, hf_greedy(ref, OTHER, 12))
    assert load.spec_decode_accepted_tokens > 0
    assert load.spec_decode_draft_tokens >= load.spec_decode_accepted_tokens
    assert load.spec_decode_drafts == engine.speculation_stats().steps > 0
