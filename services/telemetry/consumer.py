"""Telemetry for people: `tensorbus telemetry tail` and `tensorbus telemetry replay`.

Both print one JSON object per line, flushed, so `| jq` or `| grep` follow live:

1. `tail` subscribes `telemetry.v1.>` (or the subjects of the chosen kinds) with core
   NATS: it sees what is published from now on and never slows a publisher (a
   consumer that cannot keep up is cut off by the server, not waited for).
2. `replay --since 10m` creates an ephemeral JetStream pull consumer on the
   `TELEMETRY` stream starting at that time (no ack, deleted when done), reads in
   batches, and exits once it has printed the last record the stream held when the
   replay started.
3. Every record is decoded with `shared.telemetry.record_decoder` and turned into a
   dict whose first key is `kind` (`request`, `worker`, `scale`, `summary`); the other
   keys are the record's own fields (a request carries `request_id`; a heartbeat's
   own `kind`, encoder or decoder, is renamed `worker_kind`).
4. `--kind` keeps the named kinds; `--model` keeps records of that model (a summary
   keeps only that model's entry, and is dropped when it has none).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import sys
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable

import msgspec
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError

from shared import subjects
from shared.telemetry import Heartbeat, RequestRecord, ScaleDecision, Summary, record_decoder

KINDS = ("request", "worker", "scale", "summary")
SUBJECT_OF = {"request": subjects.TELEMETRY_REQUESTS, "worker": subjects.TELEMETRY_WORKERS,
              "scale": subjects.TELEMETRY_SCALE, "summary": subjects.TELEMETRY_SUMMARY}
_KIND_OF_TAG = {"request": "request", "heartbeat": "worker", "scale": "scale",
                "summary": "summary"}
FETCH_BATCH = 256

_json = msgspec.json.Encoder()


def parse_duration(text: str) -> float:
    """`90s`, `10m`, `2h`, `1h30m` or plain seconds -> seconds. ValueError otherwise."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smh])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}: use a number with s, m or h (e.g. 10m)")
    return sum(float(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


@dataclass(frozen=True)
class Filter:
    kinds: frozenset[str] = frozenset(KINDS)
    model: str = ""

    def subjects(self) -> list[str]:
        if self.kinds == frozenset(KINDS):
            return [subjects.TELEMETRY_ALL]
        return [SUBJECT_OF[k] for k in KINDS if k in self.kinds]


def parse_kinds(values: Iterable[str] | None) -> frozenset[str]:
    """`--kind request --kind scale` or `--kind request,scale`; none = every kind."""
    kinds = {k.strip() for v in values or () for k in v.split(",") if k.strip()}
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kind {sorted(unknown)}: choose from {', '.join(KINDS)}")
    return frozenset(kinds) if kinds else frozenset(KINDS)


def to_line(data: bytes, flt: Filter) -> bytes | None:
    """One encoded record -> one JSON line, or None when filtered out or undecodable."""
    try:
        rec = record_decoder.decode(data)
    except (msgspec.DecodeError, ValueError):
        return None
    body = msgspec.to_builtins(rec)
    kind = _KIND_OF_TAG[body.pop("t")]
    if "kind" in body:  # a heartbeat's own `kind` (encoder | decoder) must not shadow ours
        body["worker_kind"] = body.pop("kind")
    if kind not in flt.kinds:
        return None
    if flt.model:
        match rec:
            case Summary():
                body["models"] = [m for m in body["models"] if m["model"] == flt.model]
                if not body["models"]:
                    return None
            case RequestRecord() | Heartbeat() | ScaleDecision():
                if rec.model != flt.model:
                    return None
    return _json.encode({"kind": kind, **body}) + b"\n"


@dataclass
class Printer:
    """Writes lines to a binary stream, flushing each; counts what it wrote."""

    out: BinaryIO = field(default_factory=lambda: sys.stdout.buffer)
    limit: int = 0  # stop after this many lines (0 = no limit)
    written: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def write(self, line: bytes | None) -> None:
        if line is None or self.done.is_set():
            return
        self.out.write(line)
        self.out.flush()
        self.written += 1
        if self.limit and self.written >= self.limit:
            self.done.set()


async def tail(nc: Client, flt: Filter, printer: Printer, stop: asyncio.Event,
               on_ready: Callable[[], None] = lambda: None) -> None:
    """Print live records until `stop` is set (or the printer's limit is reached)."""
    async def on_msg(msg) -> None:
        printer.write(to_line(msg.data, flt))

    subs = [await nc.subscribe(s, cb=on_msg) for s in flt.subjects()]
    await nc.flush()  # the server knows our interest before we say we are ready
    on_ready()
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(printer.done.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        for sub in subs:
            await sub.unsubscribe()


async def replay(nc: Client, flt: Filter, printer: Printer, since_s: float | None,
                 *, fetch_timeout: float = 2.0) -> int:
    """Print stored records from `since_s` seconds ago (None: the whole stream) up to
    the stream's last record at the start; returns how many lines were printed."""
    js = nc.jetstream()
    info = await js.stream_info(subjects.TELEMETRY_STREAM)
    end_seq = info.state.last_seq
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60.0,
                            deliver_policy=DeliverPolicy.ALL)
    if since_s is not None:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=since_s)
    wanted = flt.subjects()
    if len(wanted) > 1:
        config.filter_subjects = wanted
    sub = await js.pull_subscribe(wanted[0], stream=subjects.TELEMETRY_STREAM, config=config)
    first = await sub.consumer_info()
    try:
        if first.num_pending == 0:
            return printer.written
        while not printer.done.is_set():
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=fetch_timeout)
            except (NatsTimeoutError, asyncio.TimeoutError):
                # Nothing came: the rest was filtered out or removed by the limits.
                now = await sub.consumer_info()
                # nats-py types `delivered` Optional; the server always sends it.
                if (now.num_pending == 0
                        or now.delivered.stream_seq >= end_seq):  # type: ignore[union-attr]
                    break
                continue
            for msg in msgs:
                meta = msg.metadata
                if meta.sequence.stream > end_seq:
                    return printer.written
                printer.write(to_line(msg.data, flt))
                if meta.sequence.stream >= end_seq or meta.num_pending == 0:
                    return printer.written
    finally:
        try:
            await js.delete_consumer(subjects.TELEMETRY_STREAM, first.name)
        except (NatsError, asyncio.TimeoutError):
            pass  # it expires by itself after `inactive_threshold`
        await sub.unsubscribe()
    return printer.written
