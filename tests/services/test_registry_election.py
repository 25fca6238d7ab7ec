"""The registry's writes through an election (services.registry.election): a write
stored although its ack was lost is taken as done when tried again, not as a
conflict; a real conflict stays one; a failure that is not an election's is raised
at once. (The election itself, on a real cluster: tests/reliability.)"""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import KeyWrongLastSequenceError, ServiceUnavailableError

from services.registry.election import SteadyKV


class Entry:
    def __init__(self, value: bytes, revision: int) -> None:
        self.value, self.revision = value, revision


class LossyKV:
    """A bucket of one key whose first write is stored and its ack lost."""

    def __init__(self, value: bytes | None = None) -> None:
        self.entry = Entry(value, 1) if value is not None else None
        self.writes = 0

    async def create(self, key: str, value: bytes) -> int:
        self.writes += 1
        if self.entry is not None:
            raise KeyWrongLastSequenceError()
        self.entry = Entry(value, 1)
        raise nats.errors.TimeoutError()  # stored; the ack lost with the leader

    async def get(self, key: str) -> Entry:
        return self.entry


async def test_a_write_stored_without_its_ack_is_done():
    kv = LossyKV()
    assert await SteadyKV(kv).create("k", b"mine") == 1
    assert kv.writes == 2


async def test_a_real_conflict_stays_a_conflict():
    kv = LossyKV(b"theirs")
    with pytest.raises(KeyWrongLastSequenceError):
        await SteadyKV(kv).create("k", b"mine")
    assert kv.writes == 1


async def test_an_election_is_waited_out_and_other_failures_are_not():
    calls = []

    class Electing:
        async def get(self, key):
            calls.append(key)
            if len(calls) < 3:
                raise ServiceUnavailableError()
            return Entry(b"v", 7)

    assert (await SteadyKV(Electing()).get("k")).revision == 7

    class Broken:
        async def get(self, key):
            calls.append(key)
            raise ValueError("not an election")

    calls.clear()
    with pytest.raises(ValueError):
        await SteadyKV(Broken()).get("k")
    assert len(calls) == 1
