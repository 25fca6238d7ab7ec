"""Configuration: one Struct, every field a `TENSORBUS_<NAME>` environment variable.

`Config.from_env()` reads the environment once at process start; services receive the
Struct and never read the environment themselves. docs/operations.md lists each
variable with its default (generated from this file's field comments).
"""

from __future__ import annotations

import os
from typing import Mapping

import msgspec

PREFIX = "TENSORBUS_"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    # --- bus
    nats_url: str = "nats://127.0.0.1:4222"  # where every service connects
    nats_port: int = 4222  # port of the embedded nats-server (`tensorbus nats`)
    data_dir: str = ".data"  # JetStream store, compilation cache, seeded models
    # --- gateway
    http_host: str = "127.0.0.1"  # HTTP bind address; 0.0.0.0 only on purpose
    http_port: int = 8000  # OpenAI-compatible HTTP API
    api_keys: str = ""  # comma-separated bearer keys; empty = no auth
    request_timeout_s: float = 30.0  # default deadline of a request
    max_inputs: int = 256  # embedding inputs per request
    max_payload: int = 1_048_576  # largest request body accepted (bytes)
    max_n: int = 4  # generation choices per request
    max_header_bytes: int = 16_384  # HTTP header bytes accepted
    # --- scheduler
    scheduler_id: str = ""  # stable id (probes, logs); empty = random per process
    worker_expiry_s: float = 2.0  # a worker silent this long is dropped
    max_queue_per_worker: int = 256  # fleet queue bound = this x ready workers
    stall_s: float = 10.0  # a worker holding work with no finished step this long is wedged
    cold_start_hold_s: float = 60.0  # hold requests this long while a worker warms
    target_queue_per_replica: float = 32.0  # scaling signal: desired queue per worker
    # --- worker
    worker_id: str = ""  # stable id; empty = hostname-pid
    model: str = "all-MiniLM-L6-v2"  # model this worker serves
    model_dir: str = ""  # load from this directory instead of the catalogue
    dtype: str = "float32"  # float32 | bfloat16 | float16
    engine: str = "jax"  # jax | torch
    max_batch: int = 64  # dynamic batching: largest batch
    max_wait_ms: float = 5.0  # dynamic batching: longest wait to fill a batch (0 = never)
    batch_buckets: str = "1,2,4,8,16,32,64"  # padded batch sizes compiled at warm-up
    seq_buckets: str = "16,32,64,128,256"  # padded sequence lengths
    decode_slots: int = 16  # decoder: concurrent sequences (KV cache slots)
    max_context: int = 512  # decoder: KV cache length per slot
    prefill_per_step: int = 2  # decoder: prompts admitted per decode step
    heartbeat_s: float = 0.5  # heartbeat interval
    # --- telemetry
    metrics_port: int = 9400  # Prometheus /metrics of the whole fleet
    metrics_host: str = "127.0.0.1"  # /metrics bind address; 0.0.0.0 inside a pod
    summary_interval_s: float = 5.0  # telemetry.v1.summary period
    cost_per_hour: float = 0.0  # fleet cost, for cost per 1M tokens
    # --- logs
    log_level: str = "info"  # debug / info / warning / error
    log_format: str = "auto"  # auto (JSON unless a TTY) | json | console

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Config":
        env = os.environ if env is None else env
        raw: dict[str, object] = {}
        for name in cls.__struct_fields__:
            key = PREFIX + name.upper()
            if key in env:
                raw[name] = env[key]
        raw.update(overrides)
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise SystemExit(f"bad configuration: {exc}") from None

    def with_(self, **changes) -> "Config":
        return msgspec.structs.replace(self, **changes)

    # Parsed views of the list-valued settings.
    @property
    def batch_bucket_list(self) -> tuple[int, ...]:
        return _ints(self.batch_buckets)

    @property
    def seq_bucket_list(self) -> tuple[int, ...]:
        return _ints(self.seq_buckets)

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces this config in a child process."""
        return {PREFIX + k.upper(): str(v) for k, v in msgspec.structs.asdict(self).items()}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
