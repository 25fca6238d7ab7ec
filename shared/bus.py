"""NATS connection and process lifecycle helpers shared by every service.

Connections reconnect forever (a restarted nats-server is an outage, never an exit)
and drain on shutdown so nothing in flight is dropped. Every connection logs in with
the credentials the config names (`TENSORBUS_NATS_CREDS`, `TENSORBUS_NATS_NKEY_SEED`,
`TENSORBUS_NATS_TLS_CA|CERT|KEY`, beside a user and password in the URL): services,
their probes and the CLI alike (`login_options`). `Links` lets a service act on its
connection dropping and coming back (what it had out may be lost with the path).
"""

from __future__ import annotations

import asyncio
import signal
import ssl
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import nats
import nats.errors
from nats.aio.client import Client

from shared import nkeys
from shared.config import Config, bad_config
from shared.logging import get_logger

log = get_logger("bus")


class _Client(Client):
    """nats-py's client, keeping the cluster's current members (`cluster_urls`, for
    shared.jetstream) and signing nkey and creds logins with shared.nkeys (openssl)
    instead of the `nkeys` package: nats-py calls `_setup_nkeys_connect` when
    `nkeys_seed` or `user_credentials` is set, and sends `nkey` (or `jwt`) with the
    signature."""

    cluster_urls: frozenset[str] = frozenset()  # immutable default; set per INFO

    async def flush(self, timeout: int = 10) -> None:
        """Returns once the server has every command given before the call.

        nats-py writes flush's PING straight to the socket, ahead of the commands its
        flusher task has not written yet (a SUB or PUB just made), so its PONG can
        come back before the server has seen them: a `tail` that said "ready" then
        missed the first records. The first round trip lets the flusher write them;
        the second PING follows them on the wire."""
        await super().flush(timeout)
        await super().flush(timeout)

    async def _process_info(self, info: dict, initial_connection: bool = False) -> None:
        # Keep the server's latest list of cluster members (nats-py keeps only the
        # first INFO's): a cluster still forming announces its late members here.
        if info.get("connect_urls"):
            self.cluster_urls = frozenset(info["connect_urls"])
        await super()._process_info(info, initial_connection)

    def _setup_nkeys_connect(self) -> None:
        if self._user_credentials is not None:
            path = str(self._user_credentials)
            self._user_jwt_cb = lambda: bytearray(nkeys.read_creds_file(path)[0].encode())
            self._signature_cb = lambda nonce: nkeys.sign(nkeys.read_creds_file(path)[1],
                                                          nonce.encode())
        else:
            path = str(self._nkeys_seed)
            self._public_nkey = nkeys.public_key(nkeys.read_seed_file(path))
            self._signature_cb = lambda nonce: nkeys.sign(nkeys.read_seed_file(path),
                                                          nonce.encode())


def login_options(config: Config) -> dict:
    """nats-py connect options for the credentials `config` names (none: {}).

    A file that cannot be read or used exits 78 (bad configuration), naming it."""
    opts: dict = {}
    try:
        # Read and used once now (openssl included), so a bad file or a missing
        # openssl stops the process at start rather than failing every reconnect.
        if config.nats_creds:
            nkeys.public_key(nkeys.read_creds_file(config.nats_creds)[1])
            opts["user_credentials"] = config.nats_creds
        elif config.nats_nkey_seed:
            nkeys.public_key(nkeys.read_seed_file(config.nats_nkey_seed))
            opts["nkeys_seed"] = config.nats_nkey_seed
        if config.nats_tls_ca or config.nats_tls_cert:
            ctx = ssl.create_default_context(cafile=config.nats_tls_ca or None)
            if config.nats_tls_cert:
                ctx.load_cert_chain(config.nats_tls_cert, config.nats_tls_key or None)
            opts["tls"] = ctx
        elif config.nats_tls_key:
            raise ValueError("TENSORBUS_NATS_TLS_KEY is set without TENSORBUS_NATS_TLS_CERT")
    except (nkeys.NkeyError, ValueError) as exc:
        raise bad_config(str(exc)) from None
    except (OSError, ssl.SSLError) as exc:
        raise bad_config(f"TENSORBUS_NATS_TLS_*: {exc}") from None
    return opts


async def open_client(url: str, config: Config | None = None, **kw) -> Client:
    """One connection attempt with the config's credentials (`nats.connect` otherwise);
    for commands, probes and tests that fail fast instead of waiting for the bus."""
    nc = _Client()
    config = Config.from_env() if config is None else config
    await nc.connect(servers=[u.strip() for u in url.split(",")],
                     **(login_options(config) | kw))
    return nc


async def connect(url: str, name: str, config: Config | None = None, **kw) -> Client:
    """A service's connection: reconnects forever, logs in with the credentials of
    `config` (default: read from the environment, as the process started)."""
    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)

    last: dict[str, float] = {}

    async def on_error(exc: Exception) -> None:
        # A slow consumer reports one error per dropped message: log each kind at
        # most once a second so a burst cannot flood the logs.
        kind = type(exc).__name__
        now = time.monotonic()
        if now - last.get(kind, 0.0) >= 1.0:
            last[kind] = now
            log.warning("nats_error", client=name, error=str(exc) or kind)

    opts: dict[str, Any] = dict(
        servers=[u.strip() for u in url.split(",")],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        connect_timeout=2,
        # Keep publishing into a buffer while reconnecting instead of raising.
        pending_size=64 * 1024 * 1024,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )
    opts |= login_options(Config.from_env() if config is None else config)
    opts |= kw
    # The first connection is retried too: under honcho every service starts at
    # once, and nats-server may need a moment to listen.
    delay = 0.1
    while True:
        try:
            nc = _Client()
            await nc.connect(**opts)
            return nc
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            log.info("nats_waiting", client=name, error=str(exc) or type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


@asynccontextmanager
async def connection(url: str, name: str, config: Config | None = None,
                     **kw) -> AsyncIterator[Client]:
    nc = await connect(url, name, config, **kw)
    try:
        yield nc
    finally:
        if nc.is_connected:
            try:
                await asyncio.wait_for(nc.drain(), 5)
            except Exception as exc:  # noqa: BLE001 - shutdown must finish
                log.warning("drain_failed", error=str(exc))
        await close(nc)


async def close(nc: Client, timeout: float = 5.0) -> None:
    """Close a connection, whatever state the bus left it in. With nats-server gone,
    nats-py's close writes its pending buffer to a transport that is already closed and
    raises (uvloop: RuntimeError): a service stopped then must still exit cleanly."""
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except Exception as exc:  # noqa: BLE001 - shutdown must finish
        log.warning("close_failed", client=nc.options.get("name"),
                    error=str(exc) or type(exc).__name__)


class Links:
    """A connection's ups and downs as its service sees them: `up` is set while it is
    connected, `on_drop` callbacks run when it drops (before reconnecting) and
    `on_back` ones when it is connected again (its subscriptions sent again). It
    chains the callbacks the connection was opened with (shared.bus's logging)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.up = asyncio.Event()
        if nc.is_connected:
            self.up.set()
        self.drops = 0
        self.on_drop: list = []  # plain functions, called on the event loop
        self.on_back: list = []  # the same, after a reconnection
        was_down, was_up = nc._disconnected_cb, nc._reconnected_cb

        async def down() -> None:
            self.up.clear()
            if nc.is_closed:  # closed on purpose (shutdown): no path to recover
                if was_down is not None:
                    await was_down()
                return
            self.drops += 1
            for fn in self.on_drop:
                fn()
            if was_down is not None:
                await was_down()

        async def back() -> None:
            # nats-py calls this once the subscriptions are sent again and its buffer
            # is flushed: what is published now has a path, and replies a way back.
            self.up.set()
            for fn in self.on_back:
                fn()
            if was_up is not None:
                await was_up()

        nc._disconnected_cb, nc._reconnected_cb = down, back

    async def wait_up(self, until: float) -> bool:
        """Wait until connected, or until `until` (UNIX seconds); whether it is."""
        if self.nc.is_connected:
            return True
        # Dropped, its callback not run yet: the reconnection's callback sets it again.
        self.up.clear()
        try:
            await asyncio.wait_for(self.up.wait(), max(0.0, until - time.time()))
        except TimeoutError:
            pass
        return self.nc.is_connected


def stop_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call inside the running loop)."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev
