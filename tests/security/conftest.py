"""A nats-server running deploy/nats/auth.conf, and clients that log in as one role.

The config is used as shipped: the test passwords reach it the way they reach it in
production, through `TENSORBUS_NATS_PASS_<ROLE>` in the server's environment. They
are set only while the server process starts, then removed again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from shared.natsd import NatsServer
from tests.support.bus import connect as bus_connect

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "deploy" / "nats"
ROLES = ("gateway", "scheduler", "worker", "telemetry", "batch", "deploy", "client")


def pass_var(role: str) -> str:
    return f"TENSORBUS_NATS_PASS_{role.upper()}"


@contextmanager
def environment(values: dict[str, str]):
    """Set variables for a child process to inherit, then restore the old ones."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_server(store: Path, config: Path, env: dict[str, str],
                 log: Path | None = None) -> NatsServer:
    """`log`: a file for the server's own log (its permissions violations among it)."""
    server = NatsServer(store, config=str(config), extra=["-l", str(log)] if log else None)
    with environment(env):
        server.start()
    return server


class Violations:
    """Collects the errors nats-py reports through error_cb; waits for one by text."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._cond = asyncio.Condition()

    async def on_error(self, exc: Exception) -> None:
        async with self._cond:
            self.seen.append(str(exc))
            self._cond.notify_all()

    async def wait(self, op: str, subject: str, timeout: float = 10.0) -> str:
        """Wait for `Permissions Violation for <op> to "<subject>..."` (op: Publish or
        Subscription); `subject` may be a prefix of the denied subject."""
        # nats-py lower-cases the server's -ERR text.
        needle = f'permissions violation for {op} to "{subject}'.lower()

        def found() -> str | None:
            return next((s for s in self.seen if needle in s.lower()), None)

        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: found() is not None), timeout)
        return found()

    def permission_errors(self) -> list[str]:
        return [s for s in self.seen if "permissions violation" in s.lower()]


class Role:
    """One connection logged in as `name`, with the violations it was told about."""

    def __init__(self, name: str, nc: Client, violations: Violations) -> None:
        self.name = name
        self.nc = nc
        self.violations = violations

    async def assert_clean(self) -> None:
        """A PING/PONG round trip: any -ERR for earlier operations arrives before it."""
        await self.nc.flush(timeout=10)
        assert self.violations.permission_errors() == [], self.violations.seen


class SecuredBus:
    def __init__(self, server: NatsServer, passwords: dict[str, str]) -> None:
        self.server = server
        self.passwords = passwords
        self._open: list[Client] = []

    def url_for(self, role: str, password: str | None = None) -> str:
        # The same form a service gets in TENSORBUS_NATS_URL.
        pw = self.passwords[role] if password is None else password
        return f"nats://{role}:{pw}@127.0.0.1:{self.server.port}"

    async def connect(self, role: str, password: str | None = None) -> Role:
        violations = Violations()

        async def quiet(*_a) -> None:
            return None

        nc = await bus_connect(
            self.url_for(role, password), name=f"test-{role}", allow_reconnect=False,
            connect_timeout=3, error_cb=violations.on_error,
            disconnected_cb=quiet, closed_cb=quiet,
        )
        self._open.append(nc)
        return Role(role, nc, violations)

    async def close_all(self) -> None:
        for nc in self._open:
            if not nc.is_closed:
                await nc.close()
        self._open.clear()


def make_passwords() -> dict[str, str]:
    # Letters first, then hex: the form deploy/nats/make-passwords.sh produces.
    return {role: "tb" + secrets.token_hex(16) for role in ROLES}


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory):
    passwords = make_passwords()
    env = {pass_var(r): p for r, p in passwords.items()}
    server = start_server(tmp_path_factory.mktemp("nats-auth"), NATS_DIR / "auth.conf", env)
    try:
        yield server, passwords
    finally:
        server.stop()


@pytest_asyncio.fixture
async def bus(secured_server):
    server, passwords = secured_server
    b = SecuredBus(server, passwords)
    yield b
    await b.close_all()
