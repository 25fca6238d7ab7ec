"""The JetStream stream `TELEMETRY`: every `telemetry.v1.>` record, kept for replay.

Limits retention, oldest discarded first, so the stream never grows past its bounds
and never pushes back on a publisher. Heartbeats and decisions go out as plain core NATS
publishes, stored without the publisher waiting; the gateway's request records are
JetStream publishes, acknowledged and retried off the request path
(services.gateway.recorder), so a lost server loses none.
"""

from __future__ import annotations

from typing import Any, cast

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import BadRequestError, NotFoundError

from shared import subjects
from shared.logging import get_logger

log = get_logger("telemetry.stream")

DEFAULT_MAX_AGE_S = 24 * 3600.0
DEFAULT_MAX_BYTES = 1 << 30


def stream_config(max_age_s: float = DEFAULT_MAX_AGE_S,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> StreamConfig:
    return StreamConfig(
        name=subjects.TELEMETRY_STREAM,
        description="tensorbus telemetry records (shared.telemetry, msgpack) for replay",
        subjects=[subjects.TELEMETRY_ALL],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        storage=StorageType.FILE,
    )


# The fields this module owns; anything else an operator set (replicas, placement) stays.
_OWNED = ("subjects", "retention", "discard", "max_age", "max_bytes")


async def ensure_stream(js: JetStreamContext, want: StreamConfig,
                        replicas: int | None = None) -> StreamInfo:
    """Create the stream (with `replicas` copies, when given), or bring an existing
    one's limits to `want` (idempotent; its replicas stay: `tensorbus replicas`)."""
    name = cast(str, want.name)  # a stream's config always has a name
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            info = await js.add_stream(want if replicas is None
                                       else want.evolve(num_replicas=replicas))
            log.info("stream_created", stream=want.name)
            return info
        except BadRequestError:
            # Another telemetry instance created it between our two calls.
            info = await js.stream_info(name)
    have = info.config
    changes = {f: getattr(want, f) for f in _OWNED if not _same(getattr(have, f), getattr(want, f))}
    if not changes:
        return info
    info = await js.update_stream(have.evolve(**changes))
    log.info("stream_updated", stream=want.name, fields=sorted(changes))
    return info


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) < 1e-3
    return a == b
