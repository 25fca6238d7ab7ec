"""The services wired together in one event loop, each on its own NATS connection,
as separate processes would be. Used by integration tests; a real nats-server and,
unless a test passes a mock, the real JAX engine.

With `registry=True` the gateway, the scheduler and `add_registry_worker` workers use
the JetStream registry as the processes do (`stack.registry` is the test's own
handle, for pushing versions and moving aliases)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import weakref
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats

from services.gateway.service import Gateway
from services.registry.source import ModelSource
from services.registry.store import Registry
from services.scheduler.service import Scheduler
from services.worker.service import Worker
from shared import bus
from shared.bus import close
from shared.config import Config
from shared.errors import HEADER_CODE
from tests.support.bus import connect as bus_connect


async def _connect(url: str, name: str):
    """One service's connection: a single server as nats.connect makes it; a server
    list (a cluster) as the processes make it (shared.bus: reconnecting forever), tried
    in the order given, so a test decides which member each service starts on."""
    if "," not in url:
        return await bus_connect(url, name=name)
    return await bus.connect(url, name, dont_randomize=True)


async def wait_until(cond, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll a condition (not a sleep-as-synchronisation: it returns as soon as true)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


@dataclass
class Stack:
    """A running stack; `http_url` is the gateway's HTTP API (on a free port)."""

    config: Config
    client: nats.aio.client.Client
    gateway: Gateway
    scheduler: Scheduler
    workers: dict[str, Worker] = field(default_factory=dict)
    registry: Registry | None = None  # the test's own handle (registry=True)
    cache_dir: Path | None = None  # per-stack scratch: registry fetches land here
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _exit: AsyncExitStack | None = None
    _engines: list = field(default_factory=list)  # weak refs to the test's engines, for their gates

    def open_gates(self) -> None:
        """Let every engine a test holds (`gate`, `warm_gate` cleared) go on: a test that
        fails while holding one must not hold the stack's shutdown for pytest-timeout."""
        for ref in self._engines:
            engine = ref()
            if engine is None:
                continue
            for name in ("gate", "warm_gate"):
                gate = getattr(engine, name, None)
                if gate is not None:
                    gate.set()

    async def add_worker(self, engine, worker_id: str, kind: str = "encoder",
                         wait_ready: bool = True, worker_cls=Worker,
                         time_warmup: bool = False, url: str | None = None) -> Worker:
        """`time_warmup`: time the engine at warm-up as a worker process does (off by
        default: test doubles count their engine calls, and the timing would be some).
        `url`: the worker's own server list (default: the stack's)."""
        nc = await _connect(url or self.config.nats_url, worker_id)
        self._exit.push_async_callback(close, nc)
        w = worker_cls(nc, self.config, engine, kind=kind, worker_id=worker_id,
                       time_warmup=time_warmup)
        self._engines.append(weakref.ref(engine))
        return await self._start(w, wait_ready)

    async def add_registry_worker(self, model: str, factory, worker_id: str,
                                  wait_ready: bool = True) -> Worker:
        """A worker that loads `model`'s versions from the registry with `factory`
        (`(ModelInfo, version) -> engine`) and follows its aliases, as the process does."""
        nc = await bus_connect(self.config.nats_url, name=worker_id)
        self._exit.push_async_callback(close, nc)
        source = ModelSource(await Registry.open(nc), self.cache_dir / worker_id)

        def made(*args, **kw):  # noted (weakly: a swapped-out engine must be freed), for gates
            engine = factory(*args, **kw)
            self._engines.append(weakref.ref(engine))
            return engine

        w = Worker(nc, self.config, model=model, worker_id=worker_id, source=source,
                   engine_factory=made, time_warmup=False)
        return await self._start(w, wait_ready)

    async def _start(self, w: Worker, wait_ready: bool) -> Worker:
        worker_id = w.id
        ready = asyncio.Event()
        self.workers[worker_id] = w
        self._tasks[worker_id] = asyncio.create_task(w.run(ready))
        if wait_ready:
            await asyncio.wait_for(ready.wait(), 300)
            await wait_until(lambda: any(
                v.ready for v in self.scheduler.fleet.workers.values() if v.worker_id == worker_id)
                and worker_id in self.gateway.front.fleet.workers)
        return w

    async def stop_worker(self, worker_id: str) -> None:
        self.workers[worker_id].stop()
        await self._tasks.pop(worker_id)

    async def restart_scheduler(self) -> Scheduler:
        """Stop the scheduler and start a new one (new id, new connection, nothing
        carried over), as a restarted process would be."""
        await self.stop_scheduler()
        return await self.start_scheduler()

    async def stop_scheduler(self) -> None:
        """The scheduler gone: no process subscribed to its subjects."""
        self.scheduler.stop()
        await self._tasks.pop("scheduler")
        await self.scheduler.nc.close()

    async def start_scheduler(self) -> Scheduler:
        """A new scheduler (after `stop_scheduler`), ready."""
        nc = await bus_connect(self.config.nats_url, name="scheduler")
        self._exit.push_async_callback(close, nc)
        self.scheduler = Scheduler(nc, self.config, scale_interval_s=self.scheduler.scale_interval_s)
        ready = asyncio.Event()
        self._tasks["scheduler"] = asyncio.create_task(self.scheduler.run(ready))
        await asyncio.wait_for(ready.wait(), 10)
        return self.scheduler

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def kill_worker(self, worker_id: str) -> None:
        """Vanish without a word (no drain, no heartbeat)."""
        self._tasks.pop(worker_id).cancel()
        self.workers.pop(worker_id)


async def request_that_expires(nc, subject: str, body: dict, first_s: float = 0.3,
                               tries: int = 6):
    """A request whose deadline ends while it runs: sent with a `first_s` Tensorbus-Timeout,
    doubled each time admission refuses it up front. On a loaded machine the costs the
    workers measured are high, so a short deadline can be judged too short for the
    prompt alone (a 429, nothing computed); a longer one is admitted and still ends
    inside the generation. The last reply is returned (its code: the test's to check)."""
    t = first_s
    for _ in range(tries):
        msg = await nc.request(subject, msgspec.json.encode(body), timeout=30 + t,
                               headers={"Tensorbus-Timeout": f"{t:g}"})
        if (msg.headers or {}).get(HEADER_CODE) != "429":
            return msg
        t *= 2
    return msg


def table_resolver(models: dict[str, str]):
    """A gateway model resolver that knows `models` (name -> dir) besides the catalogue."""
    from shared import catalog

    async def resolve(name: str, version: str = "", user: str = ""):
        if name in models:
            return catalog.describe(name, models[name])
        return catalog.resolve(name)

    return resolve


@asynccontextmanager
async def running_stack(nats_url: str, models: dict[str, str] | None = None,
                        registry: bool = False, scale_interval_s: float = 0.5,
                        urls: dict[str, str] | None = None, **overrides):
    """`urls`: a server list of its own for "client", "gateway" or "scheduler" (a
    cluster's members in the order that service tries them)."""
    # Decoders compile the rest of their shapes where first needed, not on a
    # background thread: a test runs few shapes, and the suite shares two cores.
    base = dict(nats_url=nats_url, heartbeat_s=0.1, worker_expiry_s=1.0, log_format="json",
                log_level="warning", http_port=0, compile_ahead="lazy")
    base.update(overrides)
    config = Config.from_env({}, **base)
    async with AsyncExitStack() as ex:
        ncs = []
        for name in ("client", "gateway", "scheduler"):
            nc = await _connect((urls or {}).get(name, nats_url), name)
            ex.push_async_callback(close, nc)
            ncs.append(nc)
        client, gnc, snc = ncs
        cache = Path(tempfile.mkdtemp(prefix="tensorbus-stack-"))
        ex.callback(shutil.rmtree, cache, ignore_errors=True)
        sched = Scheduler(snc, config, scale_interval_s=scale_interval_s,
                          registry=await Registry.open(snc) if registry else None)
        front = None
        if models or registry:
            from services.gateway.frontend import Frontend
            from services.gateway.models import ModelTable
            from services.gateway.versions import RegistryVersions
            from services.fleet import Fleet

            fleet = Fleet(expiry_s=config.worker_expiry_s)
            resolver = table_resolver(models or {})
            if registry:  # unbundled names: the registry's prod version
                resolver = RegistryVersions(await Registry.open(gnc), cache / "gateway",
                                            fleet, fallback=resolver)
            front = Frontend(gnc, config, fleet, ModelTable(fleet, resolver))
        gw = Gateway(gnc, config, front)
        s_ready, g_ready = asyncio.Event(), asyncio.Event()
        stack = Stack(config, client, gw, sched, _exit=ex, cache_dir=cache,
                      registry=await Registry.open(client) if registry else None)
        stack._tasks["scheduler"] = asyncio.create_task(sched.run(s_ready))
        stack._tasks["gateway"] = asyncio.create_task(gw.run(g_ready))
        await asyncio.wait_for(asyncio.gather(s_ready.wait(), g_ready.wait()), 10)
        try:
            yield stack
        finally:
            stack.open_gates()
            for wid in list(stack.workers):
                stack.workers[wid].stop()
            gw.stop()
            sched.stop()
            for t in stack._tasks.values():
                t.cancel()
            await asyncio.gather(*stack._tasks.values(), return_exceptions=True)
            # The gateway's own control connection: its run, cancelled, did not close it
            # (left open, it would keep reconnecting to a stopped server or cluster).
            await close(stack.gateway.front.admission.control)
