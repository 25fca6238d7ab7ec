"""Telemetry records: what `telemetry.v1.*` carries (msgpack, tagged Structs).

Consumers decode with `record_decoder`; the JetStream stream `TELEMETRY` keeps them
for replay. Field names are stable; new fields get defaults. Only a field with a
default is ever removed: decoders skip fields they do not know (no Struct here sets
`forbid_unknown_fields`), so older records still decode, and an older consumer reads
a removed field as its default.
"""

from __future__ import annotations

from bisect import bisect_left

import msgspec

# Per-token gaps, 100 us .. 5 s: the buckets of `tensorbus_inter_token_latency_seconds`.
# Workers count each request's gaps into these (one more count for +Inf), so the
# record carries a per-token histogram in 18 integers instead of every gap.
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
               0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def itl_bucket(gap_s: float) -> int:
    """Index of the ITL bucket (`le` bound) that `gap_s` falls in; the last is +Inf."""
    return bisect_left(ITL_BUCKETS, gap_s)


def itl_counts() -> list[int]:
    return [0] * (len(ITL_BUCKETS) + 1)


# Endpoints answered by an encoder in one engine call: no generated tokens, no TTFT.
ENCODER_ENDPOINTS = frozenset({"embeddings", "rerank", "score"})


class _Rec(msgspec.Struct, gc=False, tag_field="t", omit_defaults=False):
    pass


class RequestRecord(_Rec, tag="request"):
    """One finished request (any status), published by the gateway."""

    request_id: str
    endpoint: str  # "embeddings" | "rerank" | "score" | "completions" | "chat.completions" ...
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
    ttft_s: float = 0.0  # gateway receipt -> first chunk at the gateway (generation)
    itl_s: float = 0.0  # mean gap between tokens, at the worker
    batch_size: int = 0
    finished_at: float = 0.0  # UNIX seconds
    hold_s: float = 0.0  # time held waiting for a cold start (scheduler -> first ready worker)
    worker_ttft_s: float = 0.0  # worker receipt -> its first token (the worker's share of ttft_s)
    itl_counts: list[int] = msgspec.field(default_factory=list)  # gaps per ITL_BUCKETS (+Inf last)
    site: str = ""  # the answering worker's site, as its heartbeats gave it ("" = one site or none)


class Heartbeat(_Rec, tag="heartbeat"):
    """A worker's state, every `heartbeat_s`. The scheduler's registry is built on it."""

    worker_id: str
    model: str
    kind: str  # "encoder" | "decoder"
    state: str  # starting | warming | ready | draining | unhealthy | stopped
    versions: list[str]  # loaded versions, serving one first
    # Each value travels once, under one name, for encoders and decoders alike
    # (vLLM's num_requests_waiting / num_requests_running are these two, for a decoder):
    queue_depth: int  # requests (encoders) or sequences (decoders) not started yet
    in_flight: int  # requests computing (encoders) or sequences holding a slot (decoders)
    max_batch: int  # inputs per batch (encoders) or decode slots (decoders)
    batch_occupancy: float  # mean items per batch / max_batch, last interval
    steps: int  # forward passes completed since start (forward-progress check)
    rss_bytes: int
    device: str
    sent_at: float  # UNIX seconds
    last_error: str = ""
    dtype: str = "float32"
    mem_used_bytes: int = 0  # device memory in use where the backend reports it, else host RSS
    mem_limit_bytes: int = 0  # the matching limit (device capacity, cgroup or host memory)
    mem_source: str = ""  # "device" | "host"
    compiling: bool = False  # a step waits on a program being compiled: slow, not stalled
    # Decoders, as vLLM reports them (counters since the worker started); the KV
    # cache's usage is kv_blocks_used / kv_blocks_total (`kv_usage` below), not sent:
    kv_blocks_total: int = 0  # KV cache blocks of the loaded engines
    kv_blocks_used: int = 0  # of those, held by sequences
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose K/V was reused
    preemptions: int = 0  # sequences preempted to free KV cache blocks
    spec_decode_drafts: int = 0  # speculative verify passes (one draft each)
    spec_decode_draft_tokens: int = 0  # draft tokens they checked
    spec_decode_accepted_tokens: int = 0  # of those, accepted
    # Prefix-aware routing: tokens per keyed block, and the short keys
    # (shared.prefix.short) of the prompt prefixes the serving engine holds, bounded.
    prefix_block: int = 0
    prefix_keys: list[int] = []
    devices: list[str] = []  # devices the prod engine spans, e.g. ["cpu:0", "cpu:1"] (tensor parallel)
    # Encoders: engine seconds per token and per batch, timed at warm-up (0 = not timed);
    # schedulers start their cost estimate from it (shared.costs.CostBook.learn).
    cost_per_token: float = 0.0
    cost_per_batch: float = 0.0
    # Decoders: engine seconds of a prompt (per chunk, per token) and of a decode step
    # (per step, per sequence in it), timed at warm-up and refitted as the runner steps
    # (0 = not timed); schedulers admit generation by them (shared.costs.gen_cost).
    prefill_per_token: float = 0.0
    prefill_per_chunk: float = 0.0
    decode_per_step: float = 0.0
    decode_per_row: float = 0.0
    decode_length: float = 0.0  # tokens generated per token of max_tokens, recently (0 = none finished)
    # Programs compiled so far and programs the serving engine will have (the rest
    # compile in the background after ready; 0, 0: its engine compiles nothing).
    programs_compiled: int = 0
    programs_total: int = 0
    # Quantized decoders choosing their compute forms after ready: (bucket, form)
    # pairs measured so far, and in all (0, 0: none measured, the choice was stored).
    forms_measured: int = 0
    forms_total: int = 0
    # Decoders: the stored weights (TENSORBUS_QUANT, `auto` resolved) and the compute
    # form each bucket runs now ("step 16" -> "kernel8"; docs/operations.md).
    quant: str = ""
    compute_forms: dict[str, str] = {}
    start_s: float = 0.0  # seconds from the worker's start to ready (loading, warm-up; 0 = not ready yet)
    site: str = ""  # TENSORBUS_SITE of the worker ("" = one site): schedulers prefer their own
    # Times its bus connection dropped: a rise tells the scheduler that work it sent
    # meanwhile may have been lost with the path, and is sent again.
    reconnects: int = 0


def kv_usage(hb: Heartbeat) -> float:
    """The share of the worker's KV cache blocks held, 1 = full (0 without a cache)."""
    return hb.kv_blocks_used / hb.kv_blocks_total if hb.kv_blocks_total else 0.0


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
    batch_waiting: int = 0  # batch-priority requests this scheduler keeps waiting for
    # idle room (its batch lane); not demand: batch work scales nothing up


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
    cost_per_1m_input_tokens: float = 0.0
    cost_per_1m_output_tokens: float = 0.0


class Summary(_Rec, tag="summary"):
    window_s: float
    at: float
    models: list[ModelSummary]


TelemetryRecord = RequestRecord | Heartbeat | ScaleDecision | Summary

encode = msgspec.msgpack.Encoder().encode
record_decoder = msgspec.msgpack.Decoder(TelemetryRecord)
heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
