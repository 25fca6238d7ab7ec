"""Batch generations make way for interactive ones on a real stack (tiny decoder,
real nats-server, gateway, scheduler and worker): four batch requests fill the
worker's slots; an interactive request arrives; on a worker where every row costs
(a CPU: no batch row may share an interactive step) the batch sequences leave their
slots, the interactive one steps alone, and the batch ones resume from where they
were. Every text is transformers' greedy continuation on the same weights: a pause
loses and repeats nothing. What is asserted is which rows each engine step held,
never a time."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from shared import priority
from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 256
SLOTS = 4
BATCH_NEW = 120  # long enough to still be running when the interactive one comes
NEW = 8
TEXTS = ["the quick brown fox", "a lazy dog sleeps", "over the fence and far away",
         "one two three four five six"]
QUESTION = "jumps over the lazy dog"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("yields")
    model, engine = serve_tiny("gpt2", path, "tiny-yields", CONTEXT, slots=SLOTS)
    tok = engine.tokenizer
    batch = [tok.decode(hf_greedy(model, tok.encode(t), BATCH_NEW)) for t in TEXTS]
    interactive = tok.decode(hf_greedy(model, tok.encode(QUESTION), NEW))
    return engine, str(path), batch, interactive


def _body(engine, prompt: str, new: int) -> dict:
    return {"model": engine.name, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True}


async def test_batch_work_leaves_its_slots_to_interactive_work_and_resumes_unchanged(
        nats_server, tiny):
    engine, path, batch_refs, interactive_ref = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=SLOTS) as st:  # fmt: skip
        await st.add_worker(engine, "dec-yields", kind="decoder")
        runner = st.workers["dec-yields"].runner
        if engine.info.device.startswith("cpu"):  # the rule's answer on a CPU
            assert runner._riders(1) == 0
        runner.sched.riders = lambda n: 0  # the same wherever the suite runs
        lane = next(iter(runner.sched.lanes.values()))
        steps: list[tuple[int, int]] = []  # (interactive rows, batch rows) per decode step
        hold, held = threading.Event(), threading.Event()
        hold.set()
        step_async = engine.step_async

        def spy():  # on the engine thread; the loop thread waits for it meanwhile
            if not hold.is_set():
                held.set()
                hold.wait(30)
            rows = [lane.active.get(int(s)) for s in engine.table.active.nonzero()[0]]
            steps.append((sum(q is not None and not q.batch for q in rows),
                          sum(q is not None and q.batch for q in rows)))
            return step_async()

        engine.step_async = spy
        try:
            async with httpx.AsyncClient(base_url=st.http_url, timeout=120) as http:
                async def ask(prompt, new, headers=None):
                    r = await http.post("/v1/completions", json=_body(engine, prompt, new),
                                        headers=headers or {})
                    return r.status_code, r.json()

                batch = [asyncio.create_task(ask(t, BATCH_NEW, {priority.HEADER: "batch"}))
                         for t in TEXTS]
                await wait_until(lambda: len(lane.active) == SLOTS and all(
                    len(q.tokens) >= 2 for q in lane.active.values()), timeout=60)
                hold.clear()  # the next step waits on the engine thread...
                await asyncio.to_thread(held.wait, 30)
                inter = asyncio.create_task(ask(QUESTION, NEW))
                await wait_until(lambda: any(not q.batch for q in runner.sched.waiting))
                hold.set()  # ...until the interactive request waits at the worker
                code, reply = await inter
                assert code == 200 and reply["choices"][0]["text"] == interactive_ref
                assert all(not t.done() for t in batch), \
                    "the batch requests ended before the interactive one: make them longer"
                answers = await asyncio.gather(*batch)
        finally:
            engine.step_async = step_async
    assert [(c, a["choices"][0]["text"]) for c, a in answers] == \
        [(200, ref) for ref in batch_refs]  # resumed exactly where they were
    mixed = [s for s in steps if s[0] and s[1]]
    assert not mixed, f"batch rows shared a step with interactive ones: {mixed[:5]}"
    alone = [i for i, s in enumerate(steps) if s[0]]
    assert alone, "the interactive request never stepped"
    # Batch rows stepped before the interactive one and again after it.
    assert any(b for _, b in steps[:alone[0]]) and any(b for _, b in steps[alone[-1] + 1:])
