"""The decoder runner over a real paged engine (the tiny Llama): requests wait for
cache room, preempted sequences re-run, long prompts are chunked between decode
steps; every stream's text still equals transformers' greedy output."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.decoder import DecoderEngine
from engine.detok import Detokenizer
from services.worker.generation import DecoderRunner
from services.worker.versions import LoadedModels
from shared.messages import GenerateWork, Sampling
from tests.services.test_worker_runner import Recorder
from tests.support.stack import wait_until
from tests.support.tiny_models import build, hf_greedy

CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return out, build("llama", out, positions=128)


def _work(rid: str, prompt: list[int], max_tokens: int) -> GenerateWork:
    return GenerateWork(rid, "tiny", "", prompt, max_tokens, Sampling(temperature=0), [], 1,
                        True, time.time() + 120, f"reply.{rid}", "sched", ignore_eos=True)


def _expected(engine, ref, prompt: list[int], n: int) -> str:
    detok = Detokenizer(engine.tokenizer, prompt_ids=prompt, stop=[])
    return "".join(detok.feed(t) for t in hf_greedy(ref, prompt, n)) + detok.flush()


class Trace:
    """Wraps an engine; records each prefill chunk (its tokens, and how many streams
    were decoding meanwhile, waiting on it) and each step's live slots. With
    `hold_at`, the engine thread stops before that decode step until `go` is set, so
    a test places an arrival between two counted steps, not wherever the machine's
    load lets a poll land."""

    def __init__(self, engine: DecoderEngine, hold_at: int = 0) -> None:
        self.engine = engine
        self.events: list[tuple[str, object]] = []
        self.hold_at = hold_at
        self.held, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False):
        """Recorded as ("prefill", (tokens, streams decoding)) when it computed any
        (a chunk handed to the next step computes nothing here)."""
        before, decoding = self.engine.prefilling(slot), self.engine.stats().active
        first = self.engine.prefill_step(slot, budget, mix)
        if before - self.engine.prefilling(slot) or first is not None:
            self.events.append(("prefill", (before - self.engine.prefilling(slot), decoding)))
        return first

    def step_async(self):
        """Recorded as ("step", live slots), then ("mixed", (prompt tokens, streams
        decoding)) when prompt chunks rode in its pass."""
        self._hold()
        live = frozenset(self.engine.table.active.nonzero()[0].tolist())
        pending = self.engine.step_async()
        self.events.append(("step", live))
        if pending is not None and pending.prompt_tokens:
            self.events.append(("mixed", (pending.prompt_tokens, len(live))))
        return pending

    def _hold(self) -> None:
        steps = sum(kind == "step" for kind, _ in self.events)
        if steps + 1 == self.hold_at:
            self.held.set()
            self.go.wait(60)


async def _serve(engine, works: list[tuple[int, GenerateWork]], chunk: int = 512):
    """Submit each work once the runner has done `at` steps; wait for them all."""
    models = LoadedModels(engine, "1", kind="decoder")
    out = Recorder()
    runner = DecoderRunner(models, out, ThreadPoolExecutor(1), prefill_per_step=8,
                           prefill_chunk=chunk)
    task = asyncio.create_task(runner.run())
    waited = 0
    try:
        for at, w in sorted(works, key=lambda x: x[0]):
            await wait_until(lambda: runner.steps >= at, timeout=60)
            runner.submit(w)
            waited = max(waited, runner.queue_depth)
        await wait_until(lambda: len(out.finished) == len(works), timeout=300)
        return out, runner, waited
    finally:
        task.cancel()


async def _long_arrives(engine, ref) -> Trace:
    """Eight short streams decode; a 90-token prompt arrives at their 4th step (while
    it is held: 26 tokens of every short stream are still to come, more than the
    iterations its prompt takes). Every text equals transformers'; the trace of the
    engine's calls is returned."""
    trace = Trace(engine, hold_at=4)
    short = [[5 + i, 17, 30 + i, 42] for i in range(8)]
    long = list(range(2, 92))
    runner = DecoderRunner(LoadedModels(trace, "1", kind="decoder"), out := Recorder(),
                           ThreadPoolExecutor(1), prefill_per_step=8, prefill_chunk=CHUNK)
    task = asyncio.create_task(runner.run())
    try:
        for i, p in enumerate(short):
            runner.submit(_work(f"s{i}", p, 30))
        assert await asyncio.to_thread(trace.held.wait, 60)
        runner.submit(_work("long", long, 8))
        trace.go.set()
        await wait_until(lambda: len(out.finished) == 9, timeout=300)
    finally:
        trace.go.set()
        task.cancel()
    assert out.errors == []
    for i, p in enumerate(short):
        assert out.texts(f"s{i}")[0][0] == _expected(engine, ref, p, 30), i
    assert out.texts("long")[0][0] == _expected(engine, ref, long, 8)
    return trace


async def test_a_small_pool_makes_requests_wait_and_preempts_without_changing_text(tiny):
    """8 requests, 8 slots, a pool of 12 blocks (two old rows' worth): they cannot all
    fit, some wait and some are preempted as they grow; every text is unchanged."""
    path, ref = tiny
    engine = DecoderEngine(path, "tiny", slots=8, max_context=96, prefill_buckets=(16, 32),
                           decode_windows=(32, 64), kv_blocks=13)  # fmt: skip
    engine.warmup(progress=False)
    prompts = [[5 + i, 17, 30 + i, 42] + list(range(100 + i, 110 + i)) for i in range(8)]
    out, runner, waited = await _serve(engine, [(0, _work(f"r{i}", p, 40))
                                                for i, p in enumerate(prompts)])
    assert out.errors == []
    for i, p in enumerate(prompts):
        assert out.texts(f"r{i}")[0][0] == _expected(engine, ref, p, 40), i
    load = runner.gauges()
    assert load.preemptions > 0 and waited > 0
    assert (load.in_flight, load.queue_depth) == (0, 0)
    assert (load.kv_blocks_used, load.kv_blocks_total) == (0, 12)


async def test_a_long_prompt_is_chunked_and_running_streams_miss_no_step(tiny):
    """Eight streams decode; a 90-token prompt arrives at their 4th step. It is
    computed CHUNK tokens per iteration, and every decode step between its chunks
    still includes all eight streams: no stream waits more than one chunk for its
    next token. Counted on the engine's own calls, so a busy machine changes nothing."""
    path, ref = tiny
    engine = DecoderEngine(path, "tiny", slots=9, max_context=128, prefill_buckets=(16,),
                           decode_windows=(32, 64), prefill_chunk=CHUNK)  # fmt: skip
    engine.warmup(progress=False)
    trace = await _long_arrives(engine, ref)
    # Between two decode steps, at most one chunk of prompt was computed while streams
    # were decoding (a prompt with no stream waiting on it may take every chunk)...
    between, chunks = 0, 0
    steps = [e for e in trace.events if e[0] == "step"]
    for kind, what in trace.events:
        if kind == "prefill":
            tokens, decoding = what
            between += tokens if decoding else 0
            chunks += tokens > 0 and decoding > 0
        else:
            assert between <= CHUNK
            between = 0
    assert chunks >= 90 // CHUNK  # ...and the long prompt took several, all among them
    # ...and each short stream was in every step from its first to its last.
    for slot in range(8):
        live = [slot in s for _, s in steps]
        first, last = live.index(True), len(live) - 1 - live[::-1].index(True)
        assert all(live[first : last + 1]), slot


async def test_a_long_prompt_rides_in_the_streams_steps_when_they_mix(tiny):
    """The same arrival with the mixed program compiled: the 90-token prompt is
    computed inside the eight streams' own steps (decode rows and chunks in one
    pass of 16 tokens), so no pass runs a prompt while the streams wait, and each
    stream is in every step from its first to its last. Texts equal transformers'."""
    path, ref = tiny
    engine = DecoderEngine(path, "tiny", slots=9, max_context=128, prefill_buckets=(16,),
                           decode_windows=(32, 64), prefill_chunk=CHUNK)  # fmt: skip
    engine.warmup(progress=False)
    assert engine.programs.mixed_shapes == [(CHUNK, 9)]
    engine.programs.get("mixed", CHUNK, 9)  # as the background would
    assert engine.mixes()
    trace = await _long_arrives(engine, ref)
    long = list(range(2, 92))
    # No prompt pass of its own while streams decode: the long prompt's chunks all
    # rode in steps with the eight streams' rows, 16 - 8 prompt tokens each.
    assert all(what[1] == 0 for kind, what in trace.events if kind == "prefill")
    rode = [what for kind, what in trace.events if kind == "mixed" and what[1] == 8]
    assert sum(t for t, _ in rode) >= len(long) and max(t for t, _ in rode) <= CHUNK - 8
    steps = [e for e in trace.events if e[0] == "step"]
    for slot in range(8):
        live = [slot in s for _, s in steps]
        first, last = live.index(True), len(live) - 1 - live[::-1].index(True)
        assert all(live[first : last + 1]), slot
