"""One process lifecycle for every service: `python -m services.NAME` is `serve(...)`.

  1. Read the config (`Config.from_env`), run the service's own settings check (a
     setting that cannot work exits 78), configure logging once, choose the event
     loop (TENSORBUS_EVENT_LOOP; logged as `event_loop` when the process starts).
  2. SIGINT / SIGTERM set an Event (shared.bus.stop_event).
  3. Connect to NATS (retried until nats-server listens).
  4. `build(nc, config)` returns the service and any extra background work (the
     scheduler's first-start registry seeding, say).
  5. `async with running(service):` runs `service.run()` in a task. serve() then
     waits for the first of: the stop Event, the service's task ending, or an extra
     task failing.
  6. Stop the service (idempotent), cancel the extras, wait for `run()` to drain.
  7. Leaving the connection drains it (the last replies and records are flushed),
     then closes it.
  8. Exit 0 after a signal; exit 1 when the service's task ended on its own or any
     task raised: a crashed housekeeping loop must not leave a process that still
     answers `ready`. (SystemExit, e.g. exit 78 from inside the service, passes
     through unchanged.)
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, NoReturn, Protocol

from nats.aio.client import Client

from shared.bus import connection, stop_event
from shared.config import Config, bad_config
from shared.logging import configure_logging, get_logger

log = get_logger("lifecycle")

EXIT_FAILED = 1


class Lifecycle(Protocol):
    """What serve() runs: a long `run()` and an idempotent `stop()` (plain or async).
    A protocol, not a base class: a service only has the two methods."""

    def run(self) -> Coroutine[Any, Any, None]: ...

    def stop(self) -> Any: ...


@asynccontextmanager
async def running(service: Lifecycle) -> AsyncIterator[asyncio.Task]:
    """`async with running(service) as task:` runs `service.run()` in `task`; leaving
    the block calls `stop()` (awaited when it is a coroutine) and waits for `run()` to
    end, re-raising its failure. A failure already leaving the block wins over run()'s
    own (run()'s is then only awaited)."""
    task = asyncio.create_task(service.run(), name=f"{type(service).__name__}.run")
    leaving = False
    try:
        yield task
    except BaseException:
        leaving = True
        raise
    finally:
        result = service.stop()
        if inspect.isawaitable(result):
            await result
        if leaving:
            await asyncio.gather(task, return_exceptions=True)
        else:
            await task


Build = Callable[[Client, Config], Awaitable[tuple[Lifecycle, list[Coroutine]]]]


def serve(name: str, build: Build, *, client_name: str | Callable[[Config], str] | None = None,
          check: Callable[[Config], None] | None = None) -> NoReturn:
    """The whole process: steps 1-8 above. Never returns. `client_name` (the NATS
    connection's name) defaults to `name`; it may be a function of the config."""
    config = Config.from_env()
    if check is not None:
        check(config)
    configure_logging(name, config.log_level, config.log_format)
    client = client_name(config) if callable(client_name) else client_name or name
    sys.exit(run_loop(run_service(config, build, client), config.event_loop))


LoopFactory = Callable[[], asyncio.AbstractEventLoop]
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory(setting: str) -> tuple[str, LoopFactory]:
    """(name, factory) of the event loop TENSORBUS_EVENT_LOOP asks for. `auto` takes
    uvloop when it is installed, else asyncio's own loop. Asking for uvloop where it is
    not installed, or for a loop not in EVENT_LOOPS, exits 78."""
    if setting not in EVENT_LOOPS:
        raise bad_config(f"TENSORBUS_EVENT_LOOP={setting!r}: use one of {', '.join(EVENT_LOOPS)}")
    if setting != "asyncio":
        try:
            import uvloop
        except ImportError:
            if setting == "uvloop":
                raise bad_config("TENSORBUS_EVENT_LOOP=uvloop but uvloop is not installed "
                                 "(pip install uvloop; Linux and macOS only)") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run_loop(main: Coroutine[Any, Any, Any], setting: str = "auto") -> Any:
    """`asyncio.run(main)` on the event loop `setting` names (see loop_factory)."""
    try:
        _, factory = loop_factory(setting)
    except SystemExit:
        main.close()  # never started: no "never awaited" warning on the way out
        raise

    async def logged() -> Any:
        # The loop actually running (uvloop.Loop or asyncio's own), not the one asked for.
        running = type(asyncio.get_running_loop()).__module__.partition(".")[0]
        log.info("event_loop", loop=running, setting=setting)
        return await main

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(logged())


async def run_service(config: Config, build: Build, client_name: str) -> int:
    """Steps 2-7; the exit code (0 after a signal, 1 after a failure)."""
    stop = stop_event()
    async with connection(config.nats_url, client_name, config) as nc:
        service, extras = await build(nc, config)
        try:
            async with running(service) as task:
                code = await _supervise(task, extras, stop)
                if code:
                    raise _Failed(code)  # already logged: stop without re-raising
        except _Failed as failed:
            return failed.code
    return 0


class _Failed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


async def _supervise(main: asyncio.Task, extras: list[Coroutine], stop: asyncio.Event) -> int:
    waiter = asyncio.create_task(stop.wait(), name="stop-signal")
    others = {asyncio.create_task(c) for c in extras}
    pending = {main, waiter, *others}
    code = 0
    try:
        while code == 0 and waiter in pending and main in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {waiter}:
                code = max(code, _verdict(task, main, stop))
    finally:
        for task in (waiter, *others):
            task.cancel()
        await asyncio.gather(waiter, *others, return_exceptions=True)
    return code


def _verdict(task: asyncio.Task, main: asyncio.Task, stop: asyncio.Event) -> int:
    """0 for a background task that finished its job, else EXIT_FAILED (logged)."""
    if task.cancelled():
        log.error("task_cancelled", task=task.get_name())
        return EXIT_FAILED
    exc = task.exception()
    if exc is not None:
        log.error("task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}",
                  exc_info=exc)
        return EXIT_FAILED
    if task is main and not stop.is_set():
        log.error("service_ended", task=task.get_name(), why="run() returned without a stop")
        return EXIT_FAILED
    return 0
