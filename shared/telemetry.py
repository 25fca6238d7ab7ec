"""Telemetry records: what `telemetry.v1.*` carries (msgpack, tagged Structs).

Consumers decode with `record_decoder`; the JetStream stream `TELEMETRY` keeps them
for replay. Field names are stable; new fields get defaults.
"""

from __future__ import annotations

import msgspec


class _Rec(msgspec.Struct, gc=False, tag_field="t", omit_defaults=False):
    pass


class RequestRecord(_Rec, tag="request"):
    """One finished request (any status), published by the gateway."""

    request_id: str
    endpoint: str  # "embeddings" | "completions" | "chat.completions"
    model: str
    version: str
    worker_id: str
    status: int  # 200, or the error code
    error_code: str
    total_s: float  # gateway receipt -> reply sent
    queue_s: float
    batch_wait_s: float
    compute_s: float
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float = 0.0
    itl_s: float = 0.0
    batch_size: int = 0
    finished_at: float = 0.0  # UNIX seconds
    hold_s: float = 0.0  # time held waiting for a cold start (scheduler -> first ready worker)


class Heartbeat(_Rec, tag="heartbeat"):
    """A worker's state, every `heartbeat_s`. The scheduler's registry is built on it."""

    worker_id: str
    model: str
    kind: str  # "encoder" | "decoder"
    state: str  # starting | warming | ready | draining | unhealthy | stopped
    versions: list[str]  # loaded versions, serving one first
    queue_depth: int
    in_flight: int
    max_batch: int
    batch_occupancy: float  # mean items per batch / max_batch, last interval
    steps: int  # forward passes completed since start (forward-progress check)
    rss_bytes: int
    device: str
    sent_at: float  # UNIX seconds
    slots_total: int = 0
    slots_used: int = 0
    kv_usage: float = 0.0
    last_error: str = ""
    dtype: str = "float32"
    mem_used_bytes: int = 0  # device memory in use where the backend reports it, else host RSS
    mem_limit_bytes: int = 0  # the matching limit (device capacity, cgroup or host memory)
    mem_source: str = ""  # "device" | "host"


class ScaleDecision(_Rec, tag="scale"):
    """One scheduler's view of one model. With several schedulers, consumers combine
    the latest decision of each live one (`shared.scaling.combine`)."""

    model: str
    ready_replicas: int
    desired_replicas: int
    queue_depth: int
    in_flight: int
    reason: str
    at: float
    scheduler_id: str = ""
    held: int = 0  # requests this scheduler holds for a cold start
    queued: int = 0  # requests this scheduler has dispatched and not seen finish
    min_replicas: int = 0
    max_replicas: int = 0
    kind: str = ""  # encoder | decoder | "" (not known yet)
    target_per_replica: float = 0.0  # the load one replica is meant to carry
    pressured: int = 0  # ready workers above TENSORBUS_MEMORY_HIGH (no new work)


class ModelSummary(msgspec.Struct, gc=False):
    model: str
    requests: int
    errors: int
    throughput_rps: float
    p50_s: float
    p95_s: float
    p99_s: float
    tokens_per_s: float
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    cost_per_1m_tokens: float = 0.0


class Summary(_Rec, tag="summary"):
    window_s: float
    at: float
    models: list[ModelSummary]


TelemetryRecord = RequestRecord | Heartbeat | ScaleDecision | Summary

encode = msgspec.msgpack.Encoder().encode
record_decoder = msgspec.msgpack.Decoder(TelemetryRecord)
heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
