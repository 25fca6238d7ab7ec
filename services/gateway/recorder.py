"""Request records to telemetry, off the request path, and not lost with a server.

The gateway hands each finished request's record here (`put`: no wait). When the
JetStream stream `TELEMETRY` exists (looked up at most every `LOOKUP_S`), records go
out as JetStream publishes, acknowledged once stored on the stream's replicas, and
tried again (up to `TRIES` times, after the connection is back) when no ack came:
a server lost mid-publish loses no record. The wire id goes as `Nats-Msg-Id`, so a
retry whose first try was stored after all is stored once. Without the stream (one
server, no telemetry service yet) a plain publish, as before. Records wait in a
bounded queue; past `MAX_QUEUED` the newest are dropped and counted, so a bus that
stays down cannot grow the gateway without bound.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared import subjects
from shared.bus import Links
from shared.logging import get_logger

log = get_logger("gateway.recorder")

RETRY_FOR_S = 30.0  # longer than a stream's leader election after a server is lost
ACK_TIMEOUT_S = 2.0
LOOKUP_S = 30.0
MAX_QUEUED = 50_000
BATCH = 256  # records published at once (their acks awaited together)


class Recorder:
    def __init__(self, nc: Client, links: Links) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.links = links
        self.q: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(MAX_QUEUED)
        self.dropped = 0  # records the queue had no room for
        self.lost = 0  # records no try could store
        self.retried = 0
        self._stream: bool | None = None
        self._looked_at = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (within `timeout`), then stop."""
        if self._task is None:
            return
        if not self.nc.is_connected:  # the bus is gone: do not hold the shutdown
            timeout = min(timeout, 0.5)
        try:
            await asyncio.wait_for(self._flushed(), timeout)
        except TimeoutError:
            log.warning("telemetry_records_unsent", records=self.q.qsize())
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _flushed(self) -> None:
        await self.q.join()

    def put(self, msg_id: str, data: bytes) -> None:
        try:
            self.q.put_nowait((msg_id, data))
        except asyncio.QueueFull:
            self.dropped += 1

    async def _run(self) -> None:
        while True:
            batch = [await self.q.get()]
            while len(batch) < BATCH and not self.q.empty():
                batch.append(self.q.get_nowait())
            try:
                stored = await self._stored()
                await asyncio.gather(*(self._send(m, d, stored) for m, d in batch))
            finally:
                for _ in batch:
                    self.q.task_done()

    async def _stored(self) -> bool:
        """Whether the TELEMETRY stream exists (its answer kept for LOOKUP_S)."""
        now = time.monotonic()
        if self._stream is None or now - self._looked_at > LOOKUP_S:
            try:
                await self.js.stream_info(subjects.TELEMETRY_STREAM)
                self._stream = True
            except NotFoundError:
                self._stream = False
            except Exception:  # noqa: BLE001 - no answer now (an election): ask later
                return bool(self._stream)
            self._looked_at = now
        return self._stream

    async def _send(self, msg_id: str, data: bytes, stored: bool) -> None:
        if not stored:
            try:
                await self.nc.publish(subjects.TELEMETRY_REQUESTS, data)
            except Exception as exc:  # noqa: BLE001 - telemetry never fails a request
                log.warning("telemetry_publish_failed", error=str(exc))
            return
        give_up, attempt = time.monotonic() + RETRY_FOR_S, 0
        while True:
            try:
                await self.js.publish(subjects.TELEMETRY_REQUESTS, data, timeout=ACK_TIMEOUT_S,
                                      headers={"Nats-Msg-Id": msg_id})
                return
            except Exception as exc:  # noqa: BLE001 - no ack (a server lost, an election)
                if time.monotonic() > give_up:
                    self.lost += 1
                    log.warning("telemetry_record_lost", error=str(exc) or type(exc).__name__)
                    return
                self.retried += 1
                await self.links.wait_up(time.time() + ACK_TIMEOUT_S)
                # a backoff (not a synchronisation): the stream's new leader is elected
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
                attempt += 1
