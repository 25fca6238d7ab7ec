"""Text generation end to end: real nats-server, tiny real decoders, the JAX engine.

The reference is transformers' `generate` on the same saved weights. Requests run
concurrently so they share one continuous batch: equal outputs prove slot isolation.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio

from shared import subjects
from shared.errors import HEADER_CODE
from tests.support.stack import request_that_expires, running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 1024
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10))]
TEMPLATED = "hi the quick brown fox"  # a request's chat_template renders this
NEW = 32


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request, tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp(request.param)
    model, engine = serve_tiny(request.param, path, f"tiny-{request.param}", CONTEXT)
    # References are computed here, before any service runs: a synchronous torch call
    # inside a test would stall the event loop every in-process service shares.
    refs = {tuple(p): expected(model, engine, p) for p in PROMPTS}
    ids = engine.tokenizer.encode(TEMPLATED)  # what the request's own template renders
    refs[TEMPLATED] = (len(ids), *expected(model, engine, ids))
    refs["min_tokens"] = _min_tokens_reference(model, engine)
    refs["min_tokens_stop"] = _stop_string_reference(model, engine)
    return refs, engine, str(path)


MIN_TOKENS = 6


def _min_tokens_reference(model, engine):
    """(stop token, text, finish reason): transformers' greedy generation of PROMPTS[0]
    with its third token made a stop token and `min_new_tokens` = MIN_TOKENS (its
    logits processor masks the stop tokens until then, as min_tokens does)."""
    import torch

    stop = hf_greedy(model, PROMPTS[0], NEW)[2]
    ends = [*engine.eos_token_ids, stop]
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False,
                             min_new_tokens=MIN_TOKENS, eos_token_id=ends,
                             attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long))
    ids = out[0, len(PROMPTS[0]):].tolist()
    cut = next((i for i, t in enumerate(ids) if t in ends), None)
    kept = ids if cut is None else ids[:cut]
    assert cut is None or cut >= MIN_TOKENS
    return stop, engine.tokenizer.decode(kept), "length" if cut is None else "stop"


def _stop_string_reference(model, engine):
    """(stop string, text without min_tokens, text and finish reason with MIN_TOKENS):
    the stop string is the text of a token transformers' greedy answer to PROMPTS[1]
    makes third (or soon after: one with whole characters). vLLM's rule, written out:
    with min_tokens, a stop string counts only where it ends in text after that of
    the first MIN_TOKENS tokens (engine/detok.py; vLLM's detokenizer checks only the
    text new once more than min_tokens tokens are out)."""
    import torch

    prompt, eos = PROMPTS[1], set(engine.eos_token_ids)
    with torch.inference_mode():  # min_new_tokens: EOS masked until then, as min_tokens does
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             min_new_tokens=MIN_TOKENS,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ids = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(ids) if t in eos), None)
    ids = ids if cut is None else ids[:cut]
    text = engine.tokenizer.decode
    stop = next(piece for k in range(2, MIN_TOKENS)
                if (piece := text(ids[:k + 1])[len(text(ids[:k])):]).strip()
                and "\ufffd" not in piece)
    full, guard = text(ids), len(text(ids[:MIN_TOKENS]))
    assert full.find(stop) + len(stop) <= guard  # it occurs before MIN_TOKENS tokens
    at = full.find(stop, guard - len(stop) + 1)  # the first that ends past them
    held = (full, "length" if cut is None else "stop") if at < 0 else (full[:at], "stop")
    return stop, full[:full.find(stop)], held


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    _, engine, path = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4, trust_request_chat_template=True) as st:
        await st.add_worker(engine, f"dec-{engine.name}", kind="decoder")
        yield st


async def request(nc, subject, payload, timeout=30.0):
    msg = await nc.request(subject, msgspec.json.encode(payload), timeout=timeout)
    return int((msg.headers or {}).get(HEADER_CODE, 200)), msgspec.json.decode(msg.data)


async def stream(nc, subject, payload, timeout=30.0) -> list[bytes]:
    """Every message a streaming request gets, up to and including [DONE]."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, msgspec.json.encode(payload), reply=inbox)
    out = []
    while True:
        msg = await sub.next_msg(timeout=timeout)
        out.append(msg.data)
        if msg.data == b"[DONE]":
            break
    await sub.unsubscribe()
    return out


def expected(model, engine, prompt, n=NEW) -> tuple[str, str]:
    """Transformers' greedy text and finish reason for `prompt` (cut at EOS)."""
    ids = hf_greedy(model, prompt, n)
    eos = set(engine.eos_token_ids)
    cut = next((i for i, t in enumerate(ids) if t in eos), None)
    kept = ids if cut is None else ids[:cut]
    return engine.tokenizer.decode(kept), "length" if cut is None else "stop"


async def test_concurrent_greedy_equals_transformers_generate(stack, tiny):
    model, engine, _ = tiny
    reqs = [request(stack.client, subjects.COMPLETIONS,
                    {"model": engine.name, "prompt": p, "max_tokens": NEW, "temperature": 0})
            for p in PROMPTS]
    results = await asyncio.gather(*reqs)
    for prompt, (code, resp) in zip(PROMPTS, results):
        assert code == 200, resp
        text, reason = model[tuple(prompt)]
        choice = resp["choices"][0]
        assert choice["text"] == text
        assert choice["finish_reason"] == reason
        assert resp["usage"]["prompt_tokens"] == len(prompt)
        assert resp["object"] == "text_completion"


async def test_a_requests_chat_template_and_its_variables_render_the_prompt(stack, tiny):
    """vLLM's chat_template (trusted here) and chat_template_kwargs: the prompt is what
    that template renders, answered as transformers answers those tokens."""
    model, engine, _ = tiny
    count, text, reason = model[TEMPLATED]
    code, resp = await request(stack.client, subjects.CHAT_COMPLETIONS, {
        "model": engine.name, "messages": [{"role": "user", "content": "the quick brown fox"}],
        "chat_template": "{{ greeting }} {{ messages[0].content }}",
        "chat_template_kwargs": {"greeting": "hi"}, "max_tokens": NEW, "temperature": 0})
    assert code == 200, resp
    assert resp["usage"]["prompt_tokens"] == count
    assert (resp["choices"][0]["message"]["content"], resp["choices"][0]["finish_reason"]) == \
        (text, reason)
    code, resp = await request(stack.client, subjects.CHAT_COMPLETIONS, {
        "model": engine.name, "messages": [{"role": "user", "content": "x"}],
        "chat_template": "{% for %}", "max_tokens": 2})
    assert code == 400 and "cannot render the chat" in resp["error"]["message"]


async def test_include_stop_str_in_output_keeps_the_stop_string(stack, tiny):
    """vLLM's include_stop_str_in_output: the answer ends with the stop string that
    ended it (by default it ends before it), whole and streamed."""
    model, engine, _ = tiny
    prompt = PROMPTS[3]
    ref = model[tuple(prompt)][0]
    stop = ref[4:7]  # a stretch of transformers' greedy text
    cut = ref.index(stop)
    body = {"model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "stop": [stop]}
    (c1, plain), (c2, kept) = await asyncio.gather(
        request(stack.client, subjects.COMPLETIONS, body),
        request(stack.client, subjects.COMPLETIONS, {**body, "include_stop_str_in_output": True}))
    assert c1 == c2 == 200, (plain, kept)
    assert plain["choices"][0]["text"] == ref[:cut]
    assert kept["choices"][0]["text"] == ref[:cut + len(stop)]
    assert kept["choices"][0]["finish_reason"] == "stop"
    msgs = await stream(stack.client, subjects.COMPLETIONS,
                        {**body, "include_stop_str_in_output": True, "stream": True})
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref[:cut + len(stop)]


async def test_min_tokens_holds_off_eos_and_stop_tokens(stack, tiny):
    """vLLM's min_tokens: a stop token the greedy answer reaches third cannot end it
    before MIN_TOKENS tokens; the answer is transformers' with min_new_tokens."""
    model, engine, _ = tiny
    stop, text, reason = model["min_tokens"]
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0,
            "stop_token_ids": [stop]}
    (c1, early), (c2, held) = await asyncio.gather(
        request(stack.client, subjects.COMPLETIONS, body),
        request(stack.client, subjects.COMPLETIONS, {**body, "min_tokens": MIN_TOKENS}))
    assert c1 == c2 == 200, (early, held)
    assert early["usage"]["completion_tokens"] <= 3  # it stopped at the stop token
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == (text, reason)
    assert held["usage"]["completion_tokens"] >= MIN_TOKENS
    code, resp = await request(stack.client, subjects.COMPLETIONS, {**body, "min_tokens": NEW + 1})
    assert code == 400 and "min_tokens" in resp["error"]["message"]


async def test_stop_strings_are_held_until_min_tokens(stack, tiny):
    """vLLM's min_tokens holds stop strings off too: a stop string the greedy answer
    writes by its third token ends it there without min_tokens, and with it only where
    it next ends past the first MIN_TOKENS tokens' text (else at max_tokens), whole
    and streamed."""
    model, engine, _ = tiny
    stop, early, (text, reason) = model["min_tokens_stop"]
    body = {"model": engine.name, "prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0,
            "stop": [stop]}
    held_body = {**body, "min_tokens": MIN_TOKENS}
    (c1, plain), (c2, held), msgs = await asyncio.gather(
        request(stack.client, subjects.COMPLETIONS, body),
        request(stack.client, subjects.COMPLETIONS, held_body),
        stream(stack.client, subjects.COMPLETIONS, {**held_body, "stream": True}))
    assert c1 == c2 == 200, (plain, held)
    assert (plain["choices"][0]["text"], plain["choices"][0]["finish_reason"]) == (early, "stop")
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == (text, reason)
    assert held["usage"]["completion_tokens"] > MIN_TOKENS or reason == "length"
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


async def test_truncate_prompt_tokens_keeps_the_prompts_end(stack, tiny):
    """vLLM's truncate_prompt_tokens: a prompt cut to its last k tokens answers as
    those k tokens alone do (transformers' greedy text); without it, a prompt past the
    context is a 400, and with -1 it is cut to fit."""
    model, engine, _ = tiny
    prompt = PROMPTS[2]
    long = list(range(200, 240)) + prompt
    code, resp = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": long, "max_tokens": NEW, "temperature": 0,
        "truncate_prompt_tokens": len(prompt)})
    assert code == 200, resp
    assert resp["choices"][0]["text"] == model[tuple(prompt)][0]
    assert resp["usage"]["prompt_tokens"] == len(prompt)
    too_long = [7] * (CONTEXT + 10)
    code, resp = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": too_long, "max_tokens": 1})
    assert code == 400 and resp["error"]["code"] == "context_length_exceeded"
    code, resp = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": too_long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert code == 200 and resp["usage"]["prompt_tokens"] == CONTEXT - 1, resp


async def test_streaming_chunks_then_done_equal_the_whole_text(stack, tiny):
    model, engine, _ = tiny
    prompt = PROMPTS[1]
    msgs = await stream(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert msgs[-1] == b"[DONE]"
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == model[tuple(prompt)][0]
    assert len([c for c in chunks if c["choices"]]) > 1  # it really streamed
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1


async def test_continuous_usage_on_every_chunk(stack, tiny):
    """vLLM's `continuous_usage_stats` (GuideLLM sends it): usage so far on each chunk.

    Greedy, so the tokens are the reference's: a sampled run of random weights may
    draw eight byte-fragment tokens that only make text together, in one chunk."""
    _, engine, _ = tiny
    prompt = PROMPTS[0]
    msgs = await stream(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[0] >= 1 and len(counts) > 1
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8


async def test_chat_completion_and_chat_stream(stack, tiny):
    _, engine, _ = tiny
    body = {"model": engine.name, "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": 8, "temperature": 0}
    code, resp = await request(stack.client, subjects.CHAT_COMPLETIONS, body)
    assert code == 200 and resp["object"] == "chat.completion"
    msg = resp["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    msgs = await stream(stack.client, subjects.CHAT_COMPLETIONS, {**body, "stream": True})
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_max_tokens_and_stop_strings(stack, tiny):
    model, engine, _ = tiny
    prompt = PROMPTS[2]
    full, _ = model[tuple(prompt)]
    code, resp = await request(stack.client, subjects.COMPLETIONS,
                               {"model": engine.name, "prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert code == 200
    assert resp["choices"][0]["finish_reason"] == "length" and resp["usage"]["completion_tokens"] == 5
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    code, resp = await request(stack.client, subjects.COMPLETIONS, {
        "model": engine.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stop": [stop]})
    choice = resp["choices"][0]
    assert choice["text"] == full[:full.index(stop)]
    assert choice["finish_reason"] == "stop"


async def test_n_choices_and_seeded_sampling(stack, tiny):
    _, engine, _ = tiny
    body = {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0,
            "seed": 1234, "n": 3}
    code, a = await request(stack.client, subjects.COMPLETIONS, body)
    _, b = await request(stack.client, subjects.COMPLETIONS, body)
    assert code == 200 and len(a["choices"]) == 3
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1


BAD = [
    ("prompt over the context", lambda name: {"model": name, "prompt": [1] * CONTEXT}, 400, "context"),
    ("token id outside the vocabulary", lambda name: {"model": name, "prompt": [10**7]}, 400, "vocabulary"),
    ("n too large", lambda name: {"model": name, "prompt": "x", "n": 99}, 400, "'n'"),
    ("negative max_tokens", lambda name: {"model": name, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", lambda name: {"model": name, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature out of range", lambda name: {"model": name, "prompt": "x", "temperature": 9}, 400, "temperature"),
    ("top_p zero", lambda name: {"model": name, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("empty prompt", lambda name: {"model": name, "prompt": ""}, 400, "empty"),
    ("embedding model", lambda name: {"model": "all-MiniLM-L6-v2", "prompt": "x"}, 400, "embedding"),
]


@pytest.mark.parametrize("name,make,status,needle", BAD, ids=[b[0] for b in BAD])
async def test_bad_requests_fail_alone(stack, tiny, name, make, status, needle):
    model, engine, _ = tiny
    good = [request(stack.client, subjects.COMPLETIONS,
                    {"model": engine.name, "prompt": p, "max_tokens": NEW, "temperature": 0})
            for p in PROMPTS[:2]]
    bad = request(stack.client, subjects.COMPLETIONS, make(engine.name))
    (c1, r1), (c2, r2), (cb, rb) = await asyncio.gather(*good, bad)
    assert cb == status and needle in rb["error"]["message"], rb
    assert r1["choices"][0]["text"] == model[tuple(PROMPTS[0])][0]
    assert r2["choices"][0]["text"] == model[tuple(PROMPTS[1])][0]


async def test_deadline_cancels_and_frees_the_slot(stack, tiny):
    _, engine, _ = tiny
    worker = next(iter(stack.workers.values()))
    msg = await request_that_expires(
        stack.client, subjects.COMPLETIONS,
        {"model": engine.name, "prompt": PROMPTS[0], "max_tokens": CONTEXT - 10,
         "temperature": 0, "ignore_eos": True})
    assert msg.headers[HEADER_CODE] == "504"
    # The slot comes back once the worker next looks (between steps: a step that
    # compiles a longer window on a loaded machine can take seconds).
    await wait_until(lambda: worker.runner.in_flight == 0 and engine.stats().active == 0,
                     timeout=30)


async def test_the_model_card_reports_compiled_programs(stack, tiny):
    """A decoder serves once its first programs are compiled; its card says how many
    of the programs it serves are compiled so far (the rest join as they finish)."""
    _, engine, _ = tiny
    msg = await stack.client.request(subjects.MODELS, b"", timeout=5)
    card = next(c for c in msgspec.json.decode(msg.data)["data"] if c["id"] == engine.name)
    assert card["state"] == "ready" and card["kind"] == "decoder"
    assert card["programs_total"] == len(engine.programs.compiles)
    assert 0 < card["programs_compiled"] <= card["programs_total"]
    assert card["forms_measured"] == card["forms_total"] == 0  # unquantized: one form
    assert card["quant"] == "none" and card["compute_forms"] == engine.forms.compute_forms
    assert set(card["compute_forms"].values()) == {"float"} and "step 1" in card["compute_forms"]
