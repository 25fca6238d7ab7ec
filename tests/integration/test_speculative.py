"""Prompt-lookup speculation end to end: real nats-server, the tiny Llama on the JAX
engine with ngram:4. A streamed and a whole completion of a repeating prompt equal
transformers' greedy text (cut at max_tokens), and the model card reports the
acceptance the worker counted."""

from __future__ import annotations

import msgspec
import pytest
import pytest_asyncio

from shared import subjects
from tests.integration.test_generation import expected, request, stream
from tests.support.stack import running_stack, wait_until

CONTEXT = 96
REPEATING = [5, 17, 300, 42, 9, 11] * 4
NEW = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    from engine.decoder import DecoderEngine
    from tests.support.tiny_models import build

    path = tmp_path_factory.mktemp("llama-spec-e2e")
    model = build("llama", path, positions=128)
    engine = DecoderEngine(path, name="tiny-spec", slots=4, max_context=CONTEXT,
                           prefill_buckets=(16, 32), decode_windows=(32, 64), speculative=4)
    engine.warmup(progress=False)
    # The reference before any service runs (a torch call would stall the event loop).
    return expected(model, engine, REPEATING, NEW), engine, str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    _, engine, path = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, "dec-spec", kind="decoder")
        yield st


async def test_speculating_worker_serves_the_reference_text(stack, tiny):
    (text, finish), engine, _ = tiny
    body = {"model": engine.name, "prompt": REPEATING, "max_tokens": NEW, "temperature": 0}
    msgs = await stream(stack.client, subjects.COMPLETIONS, dict(body, stream=True))
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    code, resp = await request(stack.client, subjects.COMPLETIONS, body)
    assert code == 200, resp
    assert resp["choices"][0]["text"] == text and resp["choices"][0]["finish_reason"] == finish
    if finish == "length":
        assert resp["usage"]["completion_tokens"] == NEW
    assert engine.speculation_stats().accepted > 0

    # The engine may run one more verify pass after the reply (a finished sequence
    # rides the step already dispatched), so the card is compared with the counts
    # the engine holds once the gateway has a heartbeat that carries them all.
    def heard() -> bool:
        now = engine.speculation_stats()
        return any((w.hb.spec_decode_drafts, w.hb.spec_decode_draft_tokens,
                    w.hb.spec_decode_accepted_tokens) == (now.steps, now.drafted, now.accepted)
                   for w in stack.gateway.front.fleet.for_model(engine.name))  # fmt: skip

    await wait_until(heard, timeout=30)
    s = engine.speculation_stats()
    msg = await stack.client.request(subjects.MODELS, b"", timeout=5)
    card = next(c for c in msgspec.json.decode(msg.data)["data"] if c["id"] == engine.name)
    assert card["spec_decode_acceptance"] == round(s.acceptance, 4) > 0
    assert card["spec_decode_tokens_per_step"] == round(s.tokens_per_step, 4) > 1
