"""OpenAI request fields beyond the basics, through the unchanged `openai` client over
HTTP: message content as parts, the context limit, stream options, the model's own
sampling defaults, sampling controls, logprobs; and tokenize/detokenize over HTTP
and NATS. The reference is transformers on the same tiny weights."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio
import torch

from engine.chat import ChatTemplate
from shared import subjects

from shared.messages import Sampling
from tests.support.sampling_refs import reference_greedy
from tests.support.stack import running_stack
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 128
PROMPT = [5, 17, 300, 42, 9, 81]
NEW = 12
CHAT = [{"role": "user", "content": "the quick brown fox"}]
BIAS = {300: 8.0, 42: -100.0}
PENALISED = Sampling(temperature=0.0, frequency_penalty=1.2, presence_penalty=0.6,
                     repetition_penalty=1.3, logit_bias=sorted(BIAS.items()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("params")
    model, engine = serve_tiny("gpt2", path, "tiny-params", CONTEXT)
    # The model's authors ask for top_k 1: any temperature then gives greedy tokens.
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**cfg, "top_k": 1}))
    # References before any service runs (a torch call would stall the shared loop).
    refs = {"greedy": hf_greedy(model, PROMPT, NEW),
            "penalised": reference_greedy(model, PROMPT, NEW, PENALISED)}
    refs["logprobs"] = _hf_logprobs(model, PROMPT, refs["greedy"])
    chat_ids = ChatTemplate.from_dir(path).encode(engine.tokenizer, CHAT)
    refs["chat"] = hf_greedy(model, chat_ids, NEW)
    refs["chat_logprobs"] = _hf_logprobs(model, chat_ids, refs["chat"])
    with torch.no_grad():  # chat's prompt_logprobs: over the rendered prompt's tokens
        logits = model(torch.tensor([chat_ids])).logits[0].float()
    refs["chat_ids"], refs["chat_prompt"] = chat_ids, torch.log_softmax(logits, -1)[:-1].numpy()
    with torch.no_grad():  # the prompt's own: before each of its tokens after the first
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    refs["prompt_logprobs"] = torch.log_softmax(logits, -1)[:-1].numpy()
    return model, engine, str(path), refs


def _hf_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """[len(generated), V]: transformers' log_softmax before each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].numpy()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    _, engine, path, _ = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(engine, "dec-params", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def test_content_as_text_parts_is_the_joined_text(client, tiny):
    _, engine, _, _ = tiny
    parts = [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox"}]
    a = await client.chat.completions.create(
        model=engine.name, messages=[{"role": "user", "content": parts}], max_tokens=8,
        temperature=0)
    b = await client.chat.completions.create(
        model=engine.name, messages=[{"role": "user", "content": "the quick\nbrown fox"}],
        max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


async def test_other_content_parts_are_refused_by_name(client, tiny):
    _, engine, _, _ = tiny
    parts = [{"type": "text", "text": "what is this"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        await client.chat.completions.create(
            model=engine.name, messages=[{"role": "user", "content": parts}], max_tokens=4)


async def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(client, tiny):
    _, engine, _, _ = tiny
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=CONTEXT)
    msg = str(err.value)
    assert f"'max_tokens' is {CONTEXT}" in msg and f"prompt has {len(PROMPT)} tokens" in msg
    assert f"context of {CONTEXT}" in msg
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        await client.chat.completions.create(
            model=engine.name, messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=CONTEXT)
    # What the context leaves is allowed.
    ok = await client.completions.create(model=engine.name, prompt=PROMPT,
                                         max_tokens=CONTEXT - len(PROMPT), temperature=0,
                                         stop=["the"])
    assert ok.choices[0].finish_reason in ("stop", "length")


LENIENT = {  # OpenAI documents them; LangChain, LiteLLM and agent frameworks send them
    "metadata": {"job": "nightly"}, "store": False, "service_tier": "auto",
    "reasoning_effort": "low", "prediction": {"type": "content", "content": "x"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "best_of": 1,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
}


async def test_documented_fields_are_accepted_and_named_back(stack, tiny):
    """Fields OpenAI documents that nothing here acts on are accepted, whole and
    streamed, over HTTP and NATS: the answer is transformers' greedy text as without
    them, and the Tensorbus-Ignored-Fields header names them. A field no API
    documents stays a 400 naming it, and best_of above n is a 400 naming best_of."""
    _, engine, _, refs = tiny
    want = engine.tokenizer.decode(refs["chat"])
    base = {"model": engine.name, "messages": CHAT, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    named = {"metadata", "store", "service_tier", "reasoning_effort", "prediction", "functions"}

    def listed(res) -> set[str]:
        return set(res.headers["tensorbus-ignored-fields"].split(", "))

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        whole = {k: v for k, v in LENIENT.items() if k != "stream_options"}
        res = await http.post("/v1/chat/completions", json={**base, **whole})
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["message"]["content"] == want
        assert listed(res) == named
        plain = await http.post("/v1/chat/completions", json=base)
        assert "tensorbus-ignored-fields" not in plain.headers
        async with http.stream("POST", "/v1/chat/completions",
                               json={**base, **LENIENT, "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert listed(streamed) == named | {"stream_options.include_obfuscation"}
            text = ""
            async for line in streamed.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        assert text == want
        typo = await http.post("/v1/chat/completions", json={**base, "temprature": 0.5})
        assert typo.status_code == 400 and "temprature" in typo.text
        many = await http.post("/v1/chat/completions", json={**base, "best_of": 3})
        assert many.status_code == 400 and "best_of" in many.text
    reply = await stack.client.request(subjects.CHAT_COMPLETIONS,
                                       json.dumps({**base, "metadata": {"a": "b"}}).encode(),
                                       timeout=60)  # fmt: skip
    assert reply.headers["Tensorbus-Ignored-Fields"] == "metadata"
    assert json.loads(reply.data)["choices"][0]["message"]["content"] == want


async def test_stream_options_without_stream_is_a_400(client, tiny):
    _, engine, _, _ = tiny
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        await client.completions.create(model=engine.name, prompt="x", max_tokens=2,
                                        stream_options={"include_usage": True})


async def test_generation_config_defaults_apply_when_the_request_is_silent(client, tiny):
    """The model's generation_config.json says top_k 1: a hot request that leaves
    top_k unset is greedy (transformers' greedy text); one that sets it is not."""
    _, engine, _, refs = tiny
    greedy = engine.tokenizer.decode(refs["greedy"])
    silent = await client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=NEW,
                                             temperature=1.5, seed=3,
                                             extra_body={"ignore_eos": True})
    assert silent.choices[0].text == greedy
    said = await client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=NEW,
                                           temperature=1.5, seed=3,
                                           extra_body={"ignore_eos": True, "top_k": -1})
    assert said.choices[0].text != greedy


async def test_penalties_and_logit_bias_match_the_reference(client, tiny):
    _, engine, _, refs = tiny
    assert refs["penalised"] != refs["greedy"]
    body = dict(model=engine.name, prompt=PROMPT, max_tokens=NEW, temperature=0,
                frequency_penalty=PENALISED.frequency_penalty,
                presence_penalty=PENALISED.presence_penalty,
                logit_bias={str(t): b for t, b in BIAS.items()},
                extra_body={"ignore_eos": True,
                            "repetition_penalty": PENALISED.repetition_penalty})
    whole, streamed = await asyncio.gather(
        client.completions.create(**body),
        client.completions.create(**body, stream=True))
    assert whole.choices[0].text == engine.tokenizer.decode(refs["penalised"])
    text = "".join([ch.choices[0].text async for ch in streamed if ch.choices])
    assert text == whole.choices[0].text


async def test_stop_token_ids_end_the_choice_without_their_text(client, tiny):
    _, engine, _, refs = tiny
    greedy = refs["greedy"]
    at = next(i for i in range(2, NEW) if greedy[i] not in greedy[:i])
    r = await client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=NEW,
                                        temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "stop_token_ids": [greedy[at]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == engine.tokenizer.decode(greedy[:at])
    assert r.usage.completion_tokens == at + 1


@pytest.mark.parametrize("body,needle", [
    ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
])
async def test_out_of_range_controls_are_400s_naming_the_field(client, tiny, body, needle):
    _, engine, _, _ = tiny
    with pytest.raises(openai.BadRequestError, match=needle):
        await client.completions.create(model=engine.name, prompt="x", max_tokens=2, **body)


async def test_completion_logprobs_are_transformers_log_softmax(client, tiny):
    _, engine, _, refs = tiny
    greedy, ref = refs["greedy"], refs["logprobs"]
    body = dict(model=engine.name, prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=5,
                extra_body={"ignore_eos": True})
    whole, streamed = await asyncio.gather(client.completions.create(**body),
                                           client.completions.create(**body, stream=True))
    lp = whole.choices[0].logprobs
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in greedy]
    np.testing.assert_allclose(lp.token_logprobs, [ref[i, t] for i, t in enumerate(greedy)],
                               atol=1e-3)
    for i, top in enumerate(lp.top_logprobs):
        assert 1 <= len(top) <= 6 and lp.tokens[i] in top
        assert abs(max(top.values()) - ref[i].max()) < 1e-3
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(NEW)]
    pieces = [ch.choices[0].logprobs async for ch in streamed if ch.choices]
    assert sum((p.tokens for p in pieces), []) == lp.tokens
    assert sum((p.text_offset for p in pieces), []) == lp.text_offset
    # The two ran side by side, so possibly in different batch shapes: float32 noise.
    np.testing.assert_allclose(sum((p.token_logprobs for p in pieces), []), lp.token_logprobs,
                               atol=1e-5)


async def test_chat_logprobs_whole_and_streamed(client, tiny):
    _, engine, _, refs = tiny
    greedy, ref = refs["chat"], refs["chat_logprobs"]
    body = dict(model=engine.name, messages=CHAT, max_tokens=NEW, temperature=0,
                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole, streamed = await asyncio.gather(client.chat.completions.create(**body),
                                           client.chat.completions.create(**body, stream=True))
    content = whole.choices[0].logprobs.content
    assert len(content) == NEW
    for i, (item, t) in enumerate(zip(content, greedy)):
        assert item.token == engine.tokenizer.decode([t], skip_special_tokens=False)
        assert item.bytes == list(item.token.encode())
        assert abs(item.logprob - ref[i, t]) < 1e-3
        np.testing.assert_allclose([x.logprob for x in item.top_logprobs],
                                   np.sort(ref[i])[::-1][:3], atol=1e-3)
    chunks = [ch.choices[0].logprobs async for ch in streamed if ch.choices]
    assert [c.token for p in chunks if p for c in p.content] == [c.token for c in content]
    plain = await client.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=2,
                                             top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=engine.name, messages=CHAT, max_tokens=2,
                                             logprobs=True, top_logprobs=21)


def _check_prompt_logprobs(got, engine, ids: list[int], want: np.ndarray, top: int) -> None:
    """vLLM's chat `prompt_logprobs`: None for the first token, then per token a map
    token id -> {logprob, rank, decoded_token}: the token's own (rank: 1 + the tokens
    more likely there) and the `top` best (ranks 1..top), as transformers computes."""
    assert len(got) == len(ids) and got[0] is None
    for i, (t, here) in enumerate(zip(ids[1:], got[1:])):
        row = want[i]
        best = [int(x) for x in np.argsort(-row)[:top]]
        assert set(map(int, here)) == {t, *best}
        text = {k: engine.tokenizer.decode([k], skip_special_tokens=False) for k in (t, *best)}
        for rank, k in enumerate(best, 1):
            entry = here[str(k)]
            assert entry["rank"] == rank and entry["decoded_token"] == text[k]
            assert abs(entry["logprob"] - row[k]) < 1e-3
        own = here[str(t)]
        assert abs(own["logprob"] - row[t]) < 1e-3 and own["decoded_token"] == text[t]
        above = row - row[t]  # near ties (float noise) may count either way
        assert 1 + np.sum(above > 1e-3) <= own["rank"] <= 1 + np.sum(above > -1e-3)


async def _nats_chunks(nc, subject: str, body: dict) -> list[dict]:
    """A streamed request over NATS: its chunk messages, up to [DONE]."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
    out = []
    while (msg := await sub.next_msg(timeout=30)).data != b"[DONE]":
        out.append(json.loads(msg.data))
    await sub.unsubscribe()
    return out


async def test_chat_prompt_logprobs_score_the_rendered_prompt(client, stack, tiny):
    """vLLM's chat `prompt_logprobs`: the chat template's rendered tokens scored, at the
    reply's top level, whole and (on the first chunk) streamed, over HTTP and NATS."""
    _, engine, _, refs = tiny
    ids, want = refs["chat_ids"], refs["chat_prompt"]
    body = dict(model=engine.name, messages=CHAT, max_tokens=1, temperature=0)
    raw = {**body, "prompt_logprobs": 2}
    whole, streamed, nats, nats_chunks = await asyncio.gather(
        client.chat.completions.create(**body, extra_body={"prompt_logprobs": 2}),
        client.chat.completions.create(**body, stream=True, extra_body={"prompt_logprobs": 2}),
        stack.client.request(subjects.CHAT_COMPLETIONS, json.dumps(raw).encode(), timeout=30),
        _nats_chunks(stack.client, subjects.CHAT_COMPLETIONS, {**raw, "stream": True}))
    got = whole.model_dump()["prompt_logprobs"]
    _check_prompt_logprobs(got, engine, ids, want, 2)
    assert whole.choices[0].message.content == engine.tokenizer.decode(refs["chat"][:1])
    chunks = [c.model_dump() async for c in streamed]
    assert [c.get("prompt_logprobs") is not None for c in chunks] == [True] + [False] * (
        len(chunks) - 1)  # the first chunk's (the role's) alone
    for other in (chunks[0]["prompt_logprobs"], json.loads(nats.data)["prompt_logprobs"],
                  nats_chunks[0]["prompt_logprobs"]):
        _check_prompt_logprobs(other, engine, ids, want, 2)
    assert all("prompt_logprobs" not in c for c in nats_chunks[1:])
    plain = await client.chat.completions.create(**body)
    assert "prompt_logprobs" not in plain.model_dump()
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.chat.completions.create(**body, extra_body={"prompt_logprobs": 21})



async def test_completions_prompt_logprobs_on_every_choice(client, stack, tiny):
    """vLLM's completions `prompt_logprobs`: each choice carries the prompt scored as
    transformers scores it, whole and (on each choice's first chunk) streamed, over
    HTTP and NATS; each prompt of a list its own; beside `echo` + `logprobs` each
    answer keeps its own count of alternatives."""
    _, engine, _, refs = tiny
    want = refs["prompt_logprobs"]
    body = dict(model=engine.name, prompt=PROMPT, max_tokens=2, temperature=0, n=2)
    raw = {**body, "prompt_logprobs": 3}
    whole, streamed, nats, nats_chunks, listed, echoed = await asyncio.gather(
        client.completions.create(**body, extra_body={"prompt_logprobs": 3}),
        client.completions.create(**body, stream=True, extra_body={"prompt_logprobs": 3}),
        stack.client.request(subjects.COMPLETIONS, json.dumps(raw).encode(), timeout=30),
        _nats_chunks(stack.client, subjects.COMPLETIONS, {**raw, "stream": True}),
        client.completions.create(**{**body, "n": 1, "prompt": [PROMPT, PROMPT[:3]]},
                                  extra_body={"prompt_logprobs": 1}),
        client.completions.create(**{**body, "n": 1}, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3}))
    chunks = [c.model_dump() async for c in streamed]
    for choices in (whole.model_dump()["choices"], json.loads(nats.data)["choices"],
                    [echoed.model_dump()["choices"][0]]):
        assert len(choices) in (1, 2)
        for choice in choices:
            _check_prompt_logprobs(choice["prompt_logprobs"], engine, PROMPT, want, 3)
    for got in (chunks, nats_chunks):
        per_choice = [[c["choices"][0] for c in got if c["choices"] and
                       c["choices"][0]["index"] == i] for i in range(2)]
        for first, *rest in per_choice:
            _check_prompt_logprobs(first["prompt_logprobs"], engine, PROMPT, want, 3)
            assert all(c.get("prompt_logprobs") is None for c in rest)
    a, b = listed.model_dump()["choices"]
    _check_prompt_logprobs(a["prompt_logprobs"], engine, PROMPT, want, 1)
    _check_prompt_logprobs(b["prompt_logprobs"], engine, PROMPT[:3], want[:2], 1)
    n = len(PROMPT)  # echo's own: one alternative (and the token) per prompt position
    assert all(len(top) <= 2 for top in echoed.choices[0].logprobs.top_logprobs[1:n])
    plain = await client.completions.create(**body)
    assert all("prompt_logprobs" not in c for c in plain.model_dump()["choices"])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.completions.create(**body, extra_body={"prompt_logprobs": 21})

# ------------------------------------------------------------- tokenize
async def test_tokenize_and_detokenize_over_http_and_nats(stack, tiny):
    _, engine, path, _ = tiny
    text = "the quick brown fox"
    ids = engine.tokenizer.encode(text)
    chat_ids = ChatTemplate.from_dir(path).encode(engine.tokenizer, CHAT)
    bare = ChatTemplate.from_dir(path).encode(engine.tokenizer, CHAT, add_generation_prompt=False)
    assert chat_ids != bare
    cases = [
        ("tokenize", {"model": engine.name, "prompt": text},
         {"tokens": ids, "count": len(ids), "max_model_len": CONTEXT}),
        ("tokenize", {"model": engine.name, "messages": CHAT},
         {"tokens": chat_ids, "count": len(chat_ids), "max_model_len": CONTEXT}),
        ("tokenize", {"model": engine.name, "messages": CHAT, "add_generation_prompt": False},
         {"tokens": bare, "count": len(bare), "max_model_len": CONTEXT}),
        ("detokenize", {"model": engine.name, "tokens": ids}, {"prompt": text}),
    ]
    async with httpx.AsyncClient(base_url=stack.http_url) as http:
        for endpoint, body, expected in cases:
            r = await http.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == 200 and r.json() == expected, (endpoint, body, r.text)
            subject = subjects.TOKENIZE if endpoint == "tokenize" else subjects.DETOKENIZE
            msg = await stack.client.request(subject, json.dumps(body).encode(), timeout=10)
            assert json.loads(msg.data) == expected
        bad = [("tokenize", {"model": engine.name}, 400, "prompt"),
               ("tokenize", {"model": engine.name, "prompt": "x", "messages": CHAT}, 400, "prompt"),
               ("detokenize", {"model": engine.name, "tokens": [10**6]}, 400, "vocabulary"),
               ("tokenize", {"model": "nope", "prompt": "x"}, 404, "nope")]
        for endpoint, body, status, needle in bad:
            r = await http.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == status and needle in r.json()["error"]["message"], r.text


async def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, tiny):
    """lm-evaluation-harness's local-completions: `echo` and `logprobs` score the
    prompt's own tokens; the first has none (nothing before it)."""
    _, engine, _, refs = tiny
    got = await client.completions.create(model=engine.name, prompt=PROMPT, max_tokens=NEW,
                                          temperature=0, echo=True, logprobs=2)
    choice = got.choices[0]
    prompt_text = engine.tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert choice.text == prompt_text + engine.tokenizer.decode(refs["greedy"])
    lp, n = choice.logprobs, len(PROMPT)
    assert len(lp.tokens) == n + NEW and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = refs["prompt_logprobs"]
    np.testing.assert_allclose(lp.token_logprobs[1:n], [want[i, t] for i, t in
                                                        enumerate(PROMPT[1:])], atol=1e-3)
    for i in range(1, n):  # the two best at each prompt position, and the prompt's own
        best = {engine.tokenizer.decode([int(t)], skip_special_tokens=False)
                for t in np.argsort(-want[i - 1])[:2]}
        assert best <= set(lp.top_logprobs[i]) and lp.tokens[i] in lp.top_logprobs[i]
    gen = lp.token_logprobs[n:]  # then the generated tokens', as without echo
    np.testing.assert_allclose(gen, [refs["logprobs"][i, t] for i, t in
                                     enumerate(refs["greedy"])], atol=1e-3)
    assert lp.text_offset[n] == sum(len(t) for t in lp.tokens[:n])


async def test_echo_streams_the_prompt_first_and_without_logprobs_too(client, tiny):
    _, engine, _, refs = tiny
    text = "the quick brown fox"
    stream = await client.completions.create(model=engine.name, prompt=text, max_tokens=NEW,
                                             temperature=0, echo=True, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text.startswith(text)
    whole = await client.completions.create(model=engine.name, prompt=text, max_tokens=NEW,
                                            temperature=0, echo=True)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text.startswith(text) and whole.choices[0].logprobs is None
