"""The OpenAI Agents SDK (`openai-agents`) runs its tool loop unchanged against
`POST /v1/responses`: an `Agent` with one `@function_tool`, through
`OpenAIResponsesModel` on an `AsyncOpenAI` client pointed at the gateway (tracing
off, nothing leaves the machine), driven by `Runner.run`. The model must call the
tool on its first turn; the tool runs with the arguments the model produced (they
parse against the tool's own schema), its result goes back as a
`function_call_output`, and the run ends with a final text; the same through
`Runner.run_streamed` (every turn streamed over SSE). The stack is
test_responses.py's: SmolLM2-135M-Instruct on the JAX engine, behind a real
nats-server."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest_asyncio
from pydantic import Field
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)

from tests.integration.test_responses import MODEL, engine, stack  # noqa: F401 (fixtures)



@pytest_asyncio.fixture
async def sent(stack):  # noqa: F811 (the imported fixture)
    """The JSON bodies the SDK posts, in order, and the client that posts them."""
    bodies: list[dict] = []

    async def keep(req: httpx.Request) -> None:
        if req.method == "POST" and req.url.path.endswith("/responses"):
            bodies.append(json.loads(req.content))

    http = httpx.AsyncClient(timeout=120, event_hooks={"request": [keep]})
    client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none",
                                max_retries=0, http_client=http,
                                default_headers={"Tensorbus-Timeout": "120"})
    yield bodies, client
    await http.aclose()


def weather_agent(client, calls: list[str]):
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Weather in a city"""
        calls.append(city)
        return "sunny"

    # One call per turn, and a short city: the second turn's prompt (the tool's
    # definition, the call and its output) must fit the stack's 256-token context.
    return Agent(name="weather", tools=[get_weather],
                 model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                              temperature=0, max_tokens=48))


def check_the_loop(agent, calls: list[str], bodies: list[dict], result) -> None:
    # The tool really ran, once, with what the model wrote: valid for its schema.
    (city,) = calls
    jsonschema.validate({"city": city}, agent.tools[0].params_json_schema)
    first, second = bodies
    assert first["tool_choice"] == "required" and first["tools"][0]["name"] == "get_weather"
    assert first["parallel_tool_calls"] is False
    # The second turn carried the call and its output (the SDK reset tool_choice).
    assert "tool_choice" not in second
    (call,) = [i for i in second["input"] if i.get("type") == "function_call"]
    (out,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
    assert out["call_id"] == call["call_id"] and out["output"] == "sunny"
    assert json.loads(call["arguments"]) == {"city": city}
    # ... and the run ended on the model's text.
    assert isinstance(result.final_output, str) and result.final_output
    assert [r.output[-1].type for r in result.raw_responses] == ["function_call", "message"]


async def test_an_agent_calls_its_tool_and_answers(sent):
    bodies, client = sent
    set_tracing_disabled(True)
    calls: list[str] = []
    agent = weather_agent(client, calls)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
    check_the_loop(agent, calls, bodies, result)


async def test_the_same_loop_streamed(sent):
    """Runner.run_streamed: each turn a streamed response (SSE), the same loop."""
    bodies, client = sent
    set_tracing_disabled(True)
    calls: list[str] = []
    agent = weather_agent(client, calls)
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=2)
    kinds = [ev.type async for ev in result.stream_events()]
    assert all(b["stream"] is True for b in bodies)
    check_the_loop(agent, calls, bodies, result)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
