"""The batch runner: one actor that works through every batch on the public subjects.

  1. A KV watch on `batches.*` (services/batchstore.py) hands it each batch record,
     the stored ones first, then every change. A batch in an active status
     (validating, in_progress, finalizing, cancelling) that no job of this runner
     holds gets a job if this runner takes its lease (lease.py): several runners
     share the batches, one runner per batch. A batch another runner holds is
     tried again every third of TENSORBUS_BATCH_LEASE_S, and taken over once its
     lease has not moved for that long (its runner died); a job whose lease is
     lost stops. A record that turns `cancelling` tells its job to stop.
  2. validating: the input file is read and checked (lines.py). A problem fails the
     batch (`errors` lists them, by line); else it turns in_progress with its total.
  3. in_progress: the lines not yet answered (no `lines.` key: batchstore) are sent,
     in input order, each to the inference subject of its `url`
     (`inference.v1.chat.completions` ...), the same request bodies a client sends,
     each marked `Tensorbus-Priority: batch` (shared.priority): the schedulers run
     it only on capacity interactive work leaves idle, and never refuse it for the
     work ahead or its deadline (services.scheduler.lane). At most
     TENSORBUS_BATCH_CONCURRENCY requests per model, over all batches, are in flight
     (a slow model's lines do not hold back another's). A 429 or
     503 (no idle room for a long while, or no gateway) is retried after its
     Retry-After, a few times.
  4. Each answer is stored under its line's key before the batch's counts move; a
     runner that dies loses only the requests in flight, which the next one sends
     again. No line is answered twice in the output, none is lost.
  5. Cancelled (or past its 24 h window): no new line is sent, those in flight
     finish. Then finalizing: the output file (status 200 lines) and the error file
     (the rest), each in input order, go to the files store; the batch ends
     completed, cancelled or expired, with its request_counts.
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import socket
import time
from typing import Callable, cast

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.kv import KV_DEL, KV_PURGE

from services.batch.lease import Lease, Leases
from services.batch.lines import parse
from services.batchstore import BatchStore, new_id, now
from services.liveness import live_file
from services.micro import MicroService, ServiceHealth, add_service
from shared import VERSION, priority, subjects
from shared.api_batches import (
    ACTIVE,
    Batch,
    BatchErrors,
    InputLine,
    LineError,
    LineResponse,
    OutputLine,
    RequestCounts,
)
from shared.config import Config
from shared.errors import HEADER_CODE, HEADER_RETRY_AFTER
from shared.logging import get_logger

log = get_logger("batch")

SERVICE_NAME = "tensorbus-batch"
TRIES = 6  # sends of one line that met a 429 / 503 / no gateway / a lost reply
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_json = msgspec.json.Encoder()
_any = msgspec.json.Decoder()


def subject_of(endpoint: str) -> str:
    return {"/v1/chat/completions": subjects.CHAT_COMPLETIONS,
            "/v1/completions": subjects.COMPLETIONS,
            "/v1/embeddings": subjects.EMBEDDINGS}[endpoint]


class BatchRunner:
    def __init__(self, nc: Client, config: Config, store: BatchStore | None = None) -> None:
        self.nc = nc
        self.config = config
        self.store = store
        self.lanes: dict[str, asyncio.Semaphore] = {}  # model -> its requests in flight
        self.health = ServiceHealth()
        self.jobs: dict[str, asyncio.Event] = {}  # batch id -> its cancel event
        self.waiting: set[str] = set()  # active batches this runner holds no lease of
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.leases: Leases | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._micro: MicroService | None = None

    def lane(self, model: object) -> asyncio.Semaphore:
        """The bound on `model`'s requests in flight, over every batch: each model has
        its own, so a slow model's lines (a generation parked behind interactive work)
        do not hold back another model's."""
        key = model if isinstance(model, str) else ""
        sem = self.lanes.get(key)
        if sem is None:
            sem = self.lanes[key] = asyncio.Semaphore(max(1, self.config.batch_concurrency))
        return sem

    async def run(self) -> None:
        self.store = self.store or await BatchStore.open(self.nc)
        self.leases = Leases(self.store.kv, self.owner, self.config.batch_lease_s)
        watcher = await self.store.watch_batches()
        self._micro = await add_service(self.nc, SERVICE_NAME, VERSION,
                                        "runs /v1/batches on the inference subjects",
                                        health=self.health,
                                        live_file=live_file(SERVICE_NAME, self.config))
        self.health.add_check("nats", lambda: self.nc.is_connected)
        self.health.details = {"instance": self.owner}  # `--check` finds its own answer
        self.health.ready = True
        self._spawn(self._watch(watcher))
        self._spawn(self._sweep())
        try:
            await self._stop.wait()
        finally:
            self.health.ready = False
            for t in list(self._tasks):
                t.cancel()  # lines in flight are sent again by the next runner
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await watcher.stop()
            await self._micro.stop()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        self._stop.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()  # the process exits 1 (services.lifecycle)
            self._stop.set()

    async def _watch(self, watcher) -> None:
        assert self.store is not None and self.leases is not None  # run() made them first
        async for entry in watcher:
            if entry is None or entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                continue
            batch = self.store.decode_batch(entry.value)
            if batch.status not in ACTIVE:
                self.waiting.discard(batch.id)
                self.leases.forget(batch.id)
                continue
            cancel = self.jobs.get(batch.id)
            if cancel is not None:
                if batch.status == "cancelling":
                    cancel.set()
            elif batch.id not in self.waiting:
                self.waiting.add(batch.id)
                self._try(batch.id)

    async def _sweep(self) -> None:
        """Every third of the lease's time: each batch another runner holds is tried
        again (taken once its lease is released, or has stopped moving)."""
        assert self.leases is not None
        while True:
            await asyncio.sleep(self.leases.renew_s)  # a period, not a wait for an event
            for batch_id in list(self.waiting):
                self._try(batch_id)

    def _try(self, batch_id: str) -> None:
        if batch_id not in self.jobs:
            self.jobs[batch_id] = asyncio.Event()
            self._spawn(self._job(batch_id))

    async def _job(self, batch_id: str) -> None:
        leases = cast(Leases, self.leases)
        lease = None
        try:
            lease = await leases.take(batch_id)
            if lease is None:
                return  # another runner's
            if await self._hold(lease, Job(self, batch_id, self.jobs[batch_id]).run()):
                self.waiting.discard(batch_id)
        finally:
            if lease is not None:
                await leases.release(lease)
            self.jobs.pop(batch_id, None)

    async def _hold(self, lease: Lease, work) -> bool:
        """Run `work` while renewing `lease`: True when it ended, False when the
        lease was lost (the job stopped; the runner that holds it now goes on)."""
        leases = cast(Leases, self.leases)
        job = asyncio.create_task(work)
        try:
            while True:
                done, _ = await asyncio.wait({job}, timeout=leases.renew_s)
                if done:
                    job.result()  # its failure, if any, is the runner's
                    return True
                if not await leases.renew(lease):
                    return False
        finally:
            if not job.done():
                job.cancel()  # its lines in flight are sent again by the lease's holder
                await asyncio.gather(job, return_exceptions=True)


class Job:
    """One batch, from its current status to a final one."""

    def __init__(self, runner: BatchRunner, batch_id: str, cancel: asyncio.Event) -> None:
        self.runner = runner
        self.store = cast(BatchStore, runner.store)  # set: jobs start after run() opened it
        self.id = batch_id
        self.cancel = cancel

    async def run(self) -> None:
        batch = await self.store.batch(self.id)
        if batch is None or batch.status not in ACTIVE:
            return
        data = await self.store.file_bytes(batch.input_file_id)
        lines, errors = parse(data or b"", self.runner.config.batch_max_lines, batch.endpoint)
        if data is None:
            errors = [msgspec.structs.replace(errors[0], code="file_not_found",
                                              message=f"input file '{batch.input_file_id}' "
                                              "does not exist")]
        if errors:
            await self.store.change(self.id, lambda b: _failed(b, errors))
            log.info("batch_failed", batch_id=self.id, errors=len(errors))
            return
        batch = await self.store.change(self.id, lambda b: _started(b, len(lines)))
        done = await self.store.lines_done(self.id)
        batch = await self.store.change(self.id, lambda b: _counted(b, len(lines), done))
        if batch is None:  # its record was removed from the KV meanwhile: nothing to run
            log.info("batch_gone", batch_id=self.id)
            return
        if batch.status == "in_progress":
            log.info("batch_running", batch_id=self.id, total=len(lines), done=len(done))
            await self._feed(batch, lines, done)
        await self._finish(len(lines))

    async def _feed(self, batch: Batch, lines: list[InputLine], done: dict[int, bool]) -> None:
        async with asyncio.TaskGroup() as tg:
            for n, line in enumerate(lines):
                if n in done:
                    continue
                lane = self.runner.lane(line.body.get("model"))
                await lane.acquire()
                if self.cancel.is_set() or _past(batch):
                    lane.release()
                    break
                task = tg.create_task(self._one(batch, n, line))
                task.add_done_callback(_releases(lane))  # run, failed or cancelled

    async def _one(self, batch: Batch, n: int, line: InputLine) -> None:
        out = await self._send(line)
        if not await self.store.put_line(self.id, n, out):
            return  # answered already (by a runner whose lease this one took over)
        ok = out.ok
        now_ = await self.store.change(self.id, lambda b: _one_more(b, ok))
        if now_ is not None and now_.status == "cancelling":
            self.cancel.set()

    async def _send(self, line: InputLine) -> OutputLine:
        """One request, as a client sends it; retried while the answer says "not now"."""
        nc, config = self.runner.nc, self.runner.config
        rid = new_id("req_")
        headers = {"X-Request-Id": rid, "Tensorbus-Timeout": f"{config.max_generation_s:g}",
                   priority.HEADER: "batch"}
        body = _json.encode(line.body)
        problem = "no answer"
        for attempt in range(TRIES):
            wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            try:
                msg = await nc.request(subject_of(line.url), body, headers=headers,
                                       timeout=config.max_generation_s + 30)
            except NoRespondersError:
                problem = "no gateway serves the inference subjects"
            except NatsTimeout:
                problem = "the request had no answer in time"
            else:
                hdrs = msg.headers or {}
                code = int(hdrs.get(HEADER_CODE) or 200)
                if code not in (429, 503) or attempt == TRIES - 1:
                    return OutputLine(id=new_id("batch_req_"), custom_id=line.custom_id,
                                      response=LineResponse(status_code=code, request_id=rid,
                                                            body=_body(msg.data)))
                wait = _float(hdrs.get(HEADER_RETRY_AFTER)) or wait
            await asyncio.sleep(wait)
        return OutputLine(id=new_id("batch_req_"), custom_id=line.custom_id,
                          error=LineError(code="unavailable", message=problem))

    async def _finish(self, total: int) -> None:
        """Write the output and error files, then the final status."""
        batch = await self.store.change(self.id, _finalizing)
        if batch is None or batch.status not in ("finalizing", "cancelling"):
            return
        final = "cancelled" if batch.status == "cancelling" else (
            "expired" if _past(batch) else "completed")
        done = await self.store.lines_done(self.id)
        good, bad = io.BytesIO(), io.BytesIO()
        for n in sorted(done):
            (good if done[n] else bad).write(await self.store.line(self.id, n, done[n]) + b"\n")
        out_id = err_id = None
        if good.tell():
            out_id = (await self.store.put_file(f"{self.id}_output.jsonl", "batch_output",
                                                good.getvalue())).id
        if bad.tell():
            err_id = (await self.store.put_file(f"{self.id}_error.jsonl", "batch_output",
                                                bad.getvalue())).id
        counts = _counts(total, done)

        def ended(b: Batch) -> Batch:
            b.status, b.output_file_id, b.error_file_id = final, out_id, err_id
            b.request_counts = counts
            setattr(b, f"{final}_at", now())
            return b

        await self.store.change(self.id, ended)
        log.info("batch_" + final, batch_id=self.id, completed=counts.completed,
                 failed=counts.failed, total=total)


# --- record changes (each a function of the latest record: BatchStore.change)

def _failed(b: Batch, errors) -> Batch | None:
    if b.status not in ("validating", "cancelling"):
        return None
    b.status, b.failed_at, b.errors = "failed", now(), BatchErrors(data=list(errors))
    return b


def _started(b: Batch, total: int) -> Batch | None:
    if b.status != "validating":
        return None
    b.status, b.in_progress_at = "in_progress", now()
    b.request_counts = RequestCounts(total=total)
    return b


def _counted(b: Batch, total: int, done: dict[int, bool]) -> Batch:
    b.request_counts = _counts(total, done)
    return b


def _one_more(b: Batch, ok: bool) -> Batch:
    c = b.request_counts
    b.request_counts = RequestCounts(total=c.total, completed=c.completed + ok,
                                     failed=c.failed + (not ok))
    return b


def _finalizing(b: Batch) -> Batch | None:
    if b.status != "in_progress":
        return None
    b.status, b.finalizing_at = "finalizing", now()
    return b


def _counts(total: int, done: dict[int, bool]) -> RequestCounts:
    ok = sum(done.values())
    return RequestCounts(total=total, completed=ok, failed=len(done) - ok)


def _past(batch: Batch) -> bool:
    return batch.expires_at is not None and time.time() > batch.expires_at


def _body(data: bytes):
    try:
        return _any.decode(data)
    except msgspec.DecodeError:
        return {"error": {"message": data.decode(errors="replace")[:1000],
                          "type": "server_error", "code": "bad_reply"}}


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def _releases(lane: asyncio.Semaphore) -> Callable[[asyncio.Task], None]:
    """A done callback that releases `lane` (bound now, not when it runs)."""
    return lambda _: lane.release()
