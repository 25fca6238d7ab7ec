"""Prefix-aware routing over a real nats-server: two workers of the tiny Llama; a
conversation's follow-ups go to the worker that cached its earlier turns, and a
restarted scheduler routes by the same prefixes (they come with heartbeats)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from shared import subjects
from tests.integration.test_generation import request
from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import serve_tiny

CONTEXT = 512
TURN = ("The function returns None when the file is missing, and raises an error when "
        "the path names a directory instead of a file. ")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("llama")
    _, a = serve_tiny("llama", path, "tiny-llama", CONTEXT)
    _, b = serve_tiny("llama", path, "tiny-llama", CONTEXT)
    return a, b, str(path)


@pytest_asyncio.fixture(loop_scope="session")
async def stack(nats_server, engines):
    a, b, path = engines
    async with running_stack(nats_server.url, models={a.name: path}, max_context=CONTEXT,
                             decode_slots=4) as st:
        await st.add_worker(a, "dec-a", kind="decoder")
        await st.add_worker(b, "dec-b", kind="decoder")
        yield st


@pytest_asyncio.fixture(loop_scope="session")
async def slow_beats(nats_server, engines):
    """Heartbeats every 5 s (and at state changes): follow-ups come long before a
    heartbeat could announce what the last turn cached."""
    a, b, path = engines
    async with running_stack(nats_server.url, models={a.name: path}, max_context=CONTEXT,
                             decode_slots=4, heartbeat_s=5.0, worker_expiry_s=60.0) as st:
        await st.add_worker(a, "dec-a", kind="decoder")
        await st.add_worker(b, "dec-b", kind="decoder")
        yield st


def _hits(engine) -> int:
    return engine.cache_stats().hits


async def _ask(st, name: str, prompt: str) -> None:
    code, resp = await request(st.client, subjects.COMPLETIONS, {
        "model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0}, 60)
    assert code == 200, resp


async def _held_in_heartbeats(st, engine) -> None:
    """Until the scheduler's view of the worker shows what the engine caches."""
    keys = set(engine.stats(256).prefixes)
    await wait_until(lambda: keys and any(
        keys <= v.prefixes for v in st.scheduler.fleet.workers.values()), timeout=10)


def _ready(st) -> int:
    return sum(v.ready for v in st.scheduler.fleet.workers.values())


@pytest.mark.asyncio(loop_scope="session")
async def test_follow_ups_go_to_the_worker_holding_the_conversation(stack, engines):
    a, b, _ = engines
    conversation = TURN
    await _ask(stack, a.name, conversation)
    first = a if a.cache_stats().queries else b
    other = b if first is a else a
    for i in range(4):  # each follow-up extends the whole conversation
        await _held_in_heartbeats(stack, first)
        before = _hits(first)
        conversation += f" And {i}? It depends. "
        await _ask(stack, a.name, conversation)
        assert _hits(first) > before, i
    assert other.cache_stats().queries == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_a_restarted_scheduler_routes_by_the_prefixes_workers_announce(stack, engines):
    """The scheduler keeps no routing state: a new one (new id, nothing carried over)
    learns from the workers' heartbeats which holds the conversation, and its
    follow-up goes there, not to the other worker, which is as idle."""
    a, b, _ = engines
    conversation = "Restarting: " + TURN * 2
    before = {e: e.cache_stats().queries for e in (a, b)}
    await _ask(stack, a.name, conversation)
    first = a if a.cache_stats().queries > before[a] else b
    other = b if first is a else a
    await _held_in_heartbeats(stack, first)
    old = stack.scheduler
    new = await stack.restart_scheduler()
    # Nothing carried over; a heartbeat may already have reached it on a busy machine,
    # so its fleet is checked as new, not as empty.
    assert new.id != old.id and new.fleet is not old.fleet
    await wait_until(lambda: _ready(stack) == 2, timeout=10)
    await _held_in_heartbeats(stack, first)
    for i in range(5):  # by load alone (a coin toss between equals): 1 in 32
        hits, asked = first.cache_stats().hits, other.cache_stats().queries
        conversation += f" Then {i}? Only then. "
        await _ask(stack, a.name, conversation)
        assert first.cache_stats().hits > hits, i
        assert other.cache_stats().queries == asked, i
        await _held_in_heartbeats(stack, first)


@pytest.mark.asyncio(loop_scope="session")
async def test_follow_ups_before_any_heartbeat_go_where_the_last_turn_went(slow_beats, engines):
    """The scheduler counts a prompt's prefix as held by the worker it sent it to,
    until heartbeats can say: a follow-up sent as soon as the answer is in goes
    there too."""
    a, b, _ = engines
    st = slow_beats
    before = {e: e.cache_stats().queries for e in (a, b)}
    conversation = "Between heartbeats: " + TURN * 2
    await _ask(st, a.name, conversation)
    first = a if a.cache_stats().queries > before[a] else b
    other = b if first is a else a
    for i in range(5):
        hits, asked = first.cache_stats().hits, other.cache_stats().queries
        conversation += f" Next {i}? Not yet. "
        await _ask(st, a.name, conversation)
        assert first.cache_stats().hits > hits, i
        assert other.cache_stats().queries == asked, i
