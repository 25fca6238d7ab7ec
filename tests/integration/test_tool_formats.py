"""Tool calls in the form the chat template teaches, through the whole stack (a real
nats-server, gateway, scheduler, worker and the JAX engine on tiny random weights),
with the unchanged `openai` client and `tool_choice: "auto"`.

Each request brings its own short template (TENSORBUS_TRUST_REQUEST_CHAT_TEMPLATE),
one per format, that renders the tools and writes the format's marker; the gateway
reads the format from it (services/gateway/tool_formats.py). `guided_regex` cannot
force the reply here: it and `tools` would both shape it, a 400. Instead the `auto`
grammar is the force: a bias on the token a call of that format begins with makes
the random weights open a call, and from there the format's grammar writes it (the
one tool, its one enum argument). The model's tokenizer holds `<tool_call>` as one
ordinary token so that a bias can open a Hermes tag (an added token would be a
special one, which no grammar allows); the reply ends at the stop string
`</tool_call>`, kept in the output, as a Hermes model's turn ends after its call.
The reply's tokens (its logprobs) show the format's own form was written. Greedy
decoding draws the same tokens whole and streamed, so the streamed calls,
reassembled, equal the whole reply's."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio

from tests.support.stack import running_stack

CONTEXT = 512
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "the quick brown fox"}]
TURNS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
TEMPLATES = {  # each renders the tools and teaches its format, as the models' own do
    "hermes": "{{ tools | tojson }} Call in <tool_call></tool_call> tags.\n" + TURNS,
    "llama3_json": '{{ tools | tojson }} Respond as {"name": name, "parameters": args}.\n'
                   + TURNS,
    "mistral": "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] [TOOL_CALLS]\n" + TURNS,
    "pythonic": "{{ tools | tojson }} Call as [func_name(param=value)].\n" + TURNS,
}
PUSH = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[", "pythonic": "["}
OPENING = {"hermes": "<tool_call>", "llama3_json": '{"name":"get_weather","parameters":{"city":',
           "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":',
           "pythonic": "[get_weather(city="}


def _tokenizer(out_dir) -> None:
    """The tiny models' byte-level BPE (bench/support/tiny_tokenizer.py), trained also
    on the Hermes tags, whole: each becomes one token of the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bench.support.tiny_tokenizer import TEXT, VOCAB

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20 + ["<tool_call>", "</tool_call>"] * 400, trainer)
    tok.save(str(out_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, jax_cache_dir):
    from engine.decoder import DecoderEngine
    from tests.support.tiny_models import build

    path = tmp_path_factory.mktemp("tool-formats")
    build("llama", path, positions=CONTEXT)
    _tokenizer(path)
    engine = DecoderEngine(path, name="tiny-formats", slots=2, max_context=CONTEXT,
                           prefill_buckets=(16, 64), compile_ahead="lazy")
    engine.warmup(progress=False)
    assert len(engine.tokenizer.encode("<tool_call>")) == 1
    return engine, str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, tiny):
    engine, path = tiny
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=2, trust_request_chat_template=True) as st:
        await st.add_worker(engine, "dec-formats", kind="decoder")
        yield st


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0,
                              default_headers={"Tensorbus-Timeout": "120"})


@pytest.mark.parametrize("fmt", list(TEMPLATES))
async def test_auto_calls_come_in_the_templates_format(client, tiny, fmt):
    from services.gateway.tool_formats import detect

    engine, _ = tiny
    assert detect(TEMPLATES[fmt]) == fmt
    (token,) = engine.tokenizer.encode(PUSH[fmt])
    extra = {"chat_template": TEMPLATES[fmt]}
    if fmt == "hermes":
        extra |= {"stop": ["</tool_call>"], "include_stop_str_in_output": True}
    body = dict(model=engine.name, messages=ASK, max_tokens=96, temperature=0,
                tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
                logit_bias={str(token): 30}, extra_body=extra)
    whole = await client.chat.completions.create(**body, logprobs=True)
    choice = whole.choices[0]
    text = "".join(t.token for t in choice.logprobs.content)  # the reply as written
    assert text.startswith(OPENING[fmt]), text
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    deltas, content, reasons = [], "", []
    async for ch in await client.chat.completions.create(**body, stream=True):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            deltas += ch.choices[0].delta.tool_calls or []
            reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and content == ""
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
