"""A decoder worker running the torch engine, over a real nats-server: the serving
layer is the JAX engine's, unchanged, and the greedy text equals what the JAX engine
produces on the same weights. Requests run concurrently, so they share one
continuous batch in the torch engine's slots."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine.decoder.static import generate_static
from engine.torch_decoder import TorchDecoder
from shared import subjects
from tests.integration.test_generation import request, stream
from tests.support.stack import running_stack
from tests.support.tiny_models import serve_tiny

CONTEXT = 256
NEW = 32
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10)),
           list(range(200, 211))]  # fmt: skip


def _jax_texts(jax_engine) -> dict[tuple[int, ...], tuple[str, str]]:
    """The JAX engine's greedy text and finish reason per prompt (cut at EOS)."""
    eos = set(jax_engine.eos_token_ids)
    out = {}
    for prompt, ids in zip(PROMPTS, generate_static(jax_engine, PROMPTS, NEW)):
        cut = next((i for i, t in enumerate(ids) if t in eos), None)
        kept = ids if cut is None else ids[:cut]
        reason = "length" if cut is None else "stop"
        out[tuple(prompt)] = (jax_engine.tokenizer.decode(kept), reason)
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def torch_engine(request, tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp(request.param)
    name = f"tiny-torch-{request.param}"
    _, jax_engine = serve_tiny(request.param, path, name, CONTEXT)
    engine = TorchDecoder(path, name=name, slots=4, max_context=CONTEXT)
    return _jax_texts(jax_engine), engine, str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, torch_engine):
    _, engine, path = torch_engine
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, f"dec-{engine.name}", kind="decoder")
        yield st


async def test_concurrent_greedy_equals_the_jax_engine(stack, torch_engine):
    expected, engine, _ = torch_engine
    # Five requests for four slots: one waits and takes a freed slot.
    results = await asyncio.gather(*[
        request(stack.client, subjects.COMPLETIONS,
                {"model": engine.name, "prompt": p, "max_tokens": NEW, "temperature": 0})
        for p in PROMPTS])  # fmt: skip
    for prompt, (code, resp) in zip(PROMPTS, results):
        assert code == 200, resp
        text, reason = expected[tuple(prompt)]
        assert resp["choices"][0]["text"] == text
        assert resp["choices"][0]["finish_reason"] == reason
        assert resp["usage"]["prompt_tokens"] == len(prompt)


async def test_streamed_text_equals_the_jax_engine(stack, torch_engine):
    import msgspec

    expected, engine, _ = torch_engine
    prompt = PROMPTS[1]
    msgs = await stream(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
        "stream": True})
    assert msgs[-1] == b"[DONE]"
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected[tuple(prompt)][0]


async def test_seeded_sampling_repeats_on_the_torch_engine(stack, torch_engine):
    _, engine, _ = torch_engine
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0,
            "seed": 1234, "n": 3}
    code, a = await request(stack.client, subjects.COMPLETIONS, body)
    _, b = await request(stack.client, subjects.COMPLETIONS, body)
    assert code == 200 and len(a["choices"]) == 3
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("repetition_penalty", 1.2),
                                         ("logit_bias", {"5": 3.0}), ("min_p", 0.1),
                                         ("logprobs", 2)])
async def test_controls_the_torch_engine_lacks_are_400s_naming_them(stack, torch_engine, field,
                                                                    value):
    """Refused by name, never served without their effect."""
    _, engine, _ = torch_engine
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 4, field: value}
    code, reply = await request(stack.client, subjects.COMPLETIONS, body)
    assert code == 400 and field in reply["error"]["message"] and "torch" in reply["error"]["message"]
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
            "stop_token_ids": [7]}  # checked on the host: served
    code, _ = await request(stack.client, subjects.COMPLETIONS, body)
    assert code == 200
