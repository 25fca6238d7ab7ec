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
    nats_stop_grace_s: float = 4.0  # `tensorbus nats` on SIGTERM: serve connected clients this long at most, so they drain
    js_replicas: int = 0  # JetStream replicas of the registry buckets and the TELEMETRY stream when created; 0 = 3 on a cluster of 3 or more servers, else 1
    nats_creds: str = ""  # creds file (user JWT + nkey seed, from `nsc`) every connection logs in with; empty = none
    nats_nkey_seed: str = ""  # file holding this role's nkey seed (`SU...`, deploy/nats/make_nkeys.py); empty = none; ignored with a creds file
    nats_tls_ca: str = ""  # CA file that signed the server's certificate (tls.conf); empty = the system's CAs (SSL_CERT_FILE)
    nats_tls_cert: str = ""  # client certificate file for mutual TLS (tls-mtls.conf); empty = none
    nats_tls_key: str = ""  # its private key file; empty = inside the certificate file
    site: str = ""  # the site this process runs at (workers announce it; schedulers prefer workers at their own); "" = one site
    # --- gateway
    http_host: str = "127.0.0.1"  # HTTP bind address; 0.0.0.0 only on purpose
    http_port: int = 8000  # OpenAI-compatible HTTP API
    api_keys: str = ""  # comma-separated bearer keys; empty = no auth
    request_timeout_s: float = 30.0  # default deadline of a request: its wait (queue, cold-start hold) up to its first token
    stall_timeout_s: float = 30.0  # a generation that has started ends (504) when no token comes for this long
    max_generation_s: float = 600.0  # longest a request may take in all, and the most a client may ask for (Tensorbus-Timeout)
    max_inputs: int = 4096  # embedding inputs per request
    max_payload: int = 1_048_576  # largest request body accepted (bytes); the bus's own max_payload instead when that is smaller
    max_body: int = 33_554_432  # largest embeddings body over HTTP (bytes): split into works that each fit the bus
    max_n: int = 4  # generation choices per request
    trust_request_chat_template: bool = False  # chat: accept a request's own `chat_template` (a Jinja program run by the gateway, sandboxed), as vLLM's flag of that name
    reasoning_parser: str = "auto"  # chat: a reply's `<think>` reasoning apart in `reasoning_content`: auto (on when the model's chat template has think tags) / none / think (on), as VALUE[,MODEL=VALUE...]
    max_header_bytes: int = 16_384  # HTTP header bytes accepted
    max_inflight_body_bytes: int = 134_217_728  # HTTP request bodies being read and parsed at once (bytes); past it a request is a 429 with Retry-After
    max_schema_bytes: int = 262_144  # largest JSON schema, regex, choice list or grammar one structured-output field (`response_format`, `guided_*`, a tool's `parameters`) may take (bytes); over it a 400 naming the field
    max_schema_depth: int = 64  # deepest nesting of objects and lists in one such field; deeper is a 400 naming the field
    max_schema_compile_s: float = 2.0  # longest a request's grammars may take to compile (off the event loop); longer is a 400, and that structure is refused at once after
    max_file_bytes: int = 104_857_600  # largest /v1/files upload (bytes)
    sse_write_timeout_s: float = 30.0  # an SSE stream whose client takes no bytes for this long is cancelled (its work too, freeing the worker's slot)
    sse_max_buffer_bytes: int = 8_388_608  # an SSE stream whose unwritten events pass this many bytes (a client reading slower than the model writes) is cancelled
    # --- batch runner (`python -m services.batch`)
    batch_concurrency: int = 4  # requests per model, of all batches, in flight at once: the batch lane
    batch_max_lines: int = 50_000  # most requests in one batch's input file
    batch_lease_s: float = 15.0  # a batch runner's lease on a batch: renewed every third of it; a lease unmoved this long is taken over by another runner
    # --- scheduler
    scheduler_id: str = ""  # stable id (probes, logs); empty = random per process
    worker_expiry_s: float = 2.0  # a worker silent this long is dropped
    cold_start_s: float = 120.0  # a generation held for a worker that is starting waits up to this long past its deadline, within its Tensorbus-Timeout or TENSORBUS_MAX_GENERATION_S (0: its deadline)
    max_queue_per_worker: int = 256  # most requests queued per ready worker, whatever their work
    max_queue_s: float = 30.0  # queue bound in estimated compute: seconds of work ahead per ready worker
    max_redispatch: int = 2  # a request sent again this many times because its worker was lost ends (500 internal) at the next loss
    stall_s: float = 10.0  # a worker holding work with no finished step this long is wedged (time a step waits on a compile does not count)
    target_queue_per_replica: float = 32.0  # scaling signal: desired queue per worker
    prefix_route_imbalance: int = 4  # scheduler: extra requests a worker caching a prompt's prefix may hold over the least loaded and still get it (-1 = route by load only)
    target_slots_per_replica: float = 0.0  # scaling signal: desired busy decode slots per decoder worker (0 = three quarters of decode_slots)
    # --- fleet sizing (scheduler decides, the orchestrator or KEDA acts)
    min_workers: int = 1  # fewest workers per model (0 = may scale to zero)
    max_workers: int = 4  # most workers per model
    idle_to_zero_s: float = 0.0  # idle this long -> 0 workers (needs min 0; 0 = never)
    scale_down_s: float = 30.0  # demand must stay lower this long before scaling down
    fleet: str = ""  # per-model MODEL=MIN:MAX, comma-separated (MODEL=0:0 = not served)
    memory_high: float = 0.9  # a worker above this fraction of its memory limit gets no new work
    # --- local orchestrator (`python -m services.orchestrator`)
    local_workers: int = 0  # most worker processes on this machine; 0 = max(4, CPU cores)
    worker_threads: str = "shared"  # engine threads per local worker: shared (every worker all cores: an idle one holds none) | split (the cores divided between the workers) | N
    drain_timeout_s: float = 30.0  # a worker still draining this long after SIGTERM is killed
    # --- worker
    worker_id: str = ""  # stable id; empty = hostname-pid
    model: str = "all-MiniLM-L6-v2"  # model this worker serves
    model_dir: str = ""  # load from this directory instead of the catalogue
    dtype: str = "float32"  # float32 / bfloat16 / float16, as VALUE[,MODEL=VALUE...]
    engine: str = "jax"  # jax / torch / onnx (encoders only; float or TENSORBUS_QUANT=int8), as VALUE[,MODEL=VALUE...]; unknown = exit 78
    tensor_parallel: str = "1"  # devices per worker (jax engine), as VALUE[,MODEL=VALUE...]; heads must divide
    quant: str = "auto"  # stored weights: auto (gguf for a GGUF decoder where the CPU kernel runs, else none) / none / int8 / int4 / fp8 / gguf (a GGUF file's own blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) (jax engine), as VALUE[,MODEL=VALUE...]
    quant_form: str = "auto"  # quantized decoders' matmuls: auto (fastest per bucket, measured once, after ready) / float / dequant / w8a8 / kernel (the CPU kernel over int8/int4 groups; float32, one device; auto considers it for gguf) / kernel8 (the kernel with int8 activations for 4-bit groups), as VALUE[,MODEL=VALUE...]
    weight_budget_mb: str = "0"  # MB all held weight forms may take (0 = the model's float32 size), as VALUE[,MODEL=VALUE...]
    max_batch: int = 64  # dynamic batching: largest batch
    max_wait_ms: float = 5.0  # dynamic batching: longest wait to fill a batch (0 = never; at most a recent batch's compute time)
    engine_nice: int = 0  # added to the nice value of the engine's threads (Linux): the serving path first on shared cores
    batch_buckets: str = "1,2,4,8,16,32,64"  # padded batch sizes compiled at warm-up
    seq_buckets: str = "16,32,64,128,256"  # padded sequence lengths
    decode_slots: int = 64  # decoder: concurrent sequences (decode batch); the KV pool bounds their tokens
    max_context: int = 8192  # decoder: longest sequence, prompt and output (capped at the model's limit)
    kv_block: int = 16  # decoder: tokens per KV cache block
    kv_blocks: int = 512  # decoder: KV pool per engine, in blocks (0 = a full context for every slot)
    attention: str = "auto"  # decoder: paged attention: auto (pallas on a GPU, cpu on a CPU where the kernel builds, else xla) | xla | pallas | cpu
    compile_ahead: str = "first"  # compiled before ready: first (what a first request needs; the rest in the background; an encoder: its smallest program, one row of its limit and its full-size ones) | all | lazy (a decoder's rest where first needed; an encoder: all)
    prefill_chunk: int = 0  # decoder: most prompt tokens computed between two decode steps (0: 128 on a CPU, 512 on an accelerator)
    prefix_cache: bool = True  # decoder: reuse cached K/V of shared prompt prefixes
    mixed_steps: bool = True  # decoder (jax engine, CPU kernel): prompt chunks ride in the decode step's pass
    prefill_per_step: int = 2  # decoder: prompts admitted per decode step
    speculative: str = "off"  # decoder (jax engine): prompt-lookup speculation of a lone stream: off | ngram:K (K draft tokens per step), as VALUE[,MODEL=VALUE...]
    heartbeat_s: float = 0.5  # heartbeat interval
    # --- telemetry
    metrics_port: int = 9400  # Prometheus /metrics of the whole fleet
    metrics_host: str = "127.0.0.1"  # /metrics bind address; 0.0.0.0 inside a pod
    summary_interval_s: float = 5.0  # telemetry.v1.summary period
    cost_per_hour: str = "0"  # price of one worker-hour, VALUE[,KEY=VALUE...]; KEY a model or device kind (cpu, cuda)
    # --- process
    event_loop: str = "auto"  # every service's event loop: auto (uvloop when installed, else asyncio) | asyncio | uvloop (missing = exit 78)
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
            raise bad_config(str(exc)) from None

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

    def for_model(self, name: str, model: str) -> str:
        """A per-model setting (`VALUE[,MODEL=VALUE...]`) resolved for `model`."""
        return per_model(getattr(self, name), model)

    def worker_price(self, model: str, device: str = "") -> float:
        """Price of one worker-hour of `model` on `device` ('cpu', 'cuda:0', ...):
        `MODEL=VALUE` first, then the device kind (`cuda=VALUE`), then the default.
        ValueError when the setting is malformed or a price is negative."""
        default, per = parse_per_model(self.cost_per_hour)
        prices = {key: _price(raw) for key, raw in per.items()}
        kind = device.partition(":")[0]
        if model in prices:
            return prices[model]
        return prices.get(kind, _price(default or "0"))

    def fleet_bounds(self, model: str) -> tuple[int, int]:
        """(min, max) workers for `model`: TENSORBUS_FLEET, else the global bounds."""
        return parse_fleet(self.fleet).get(model, (self.min_workers, self.max_workers))

    def worker_budget(self, cores: int) -> int:
        """Most worker processes the local orchestrator runs on a `cores`-core machine."""
        return self.local_workers if self.local_workers > 0 else max(4, cores)

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces this config in a child process."""
        return {PREFIX + k.upper(): str(v) for k, v in msgspec.structs.asdict(self).items()}


EX_CONFIG = 78  # sysexits.h EX_CONFIG: invalid configuration, do not restart


def bad_config(message: str) -> SystemExit:
    """Print `message` and exit with EX_CONFIG (a supervisor does not restart it)."""
    import sys

    print(f"bad configuration: {message}", file=sys.stderr, flush=True)
    return SystemExit(EX_CONFIG)


def parse_per_model(spec: str) -> tuple[str, dict[str, str]]:
    """`VALUE[,MODEL=VALUE...]` -> (default, {model: value}). ValueError when malformed."""
    default, per = "", {}
    for i, part in enumerate(p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" in part:
            model, _, value = part.partition("=")
            if not model.strip() or not value.strip():
                raise ValueError(f"bad per-model entry {part!r}: use MODEL=VALUE")
            per[model.strip()] = value.strip()
        elif i == 0:
            default = part
        else:
            raise ValueError(f"bad entry {part!r}: only the first value may lack MODEL=")
    return default, per


def per_model(spec: str, model: str) -> str:
    default, per = parse_per_model(spec)
    return per.get(model, default)


def parse_fleet(spec: str) -> dict[str, tuple[int, int]]:
    """`MODEL=MIN:MAX,...` -> {model: (min, max)}, in the order written.

    ValueError with a message a person can act on when malformed."""
    out: dict[str, tuple[int, int]] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        model, eq, bounds = part.rpartition("=")
        lo, colon, hi = bounds.partition(":")
        try:
            if not eq or not model or not colon:
                raise ValueError
            low, high = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"TENSORBUS_FLEET entry {part!r}: use MODEL=MIN:MAX") from None
        if low < 0 or high < low:
            raise ValueError(f"TENSORBUS_FLEET entry {part!r}: need 0 <= MIN <= MAX")
        if model in out:
            raise ValueError(f"TENSORBUS_FLEET names {model!r} twice")
        out[model] = (low, high)
    return out


def _price(raw: str) -> float:
    try:
        price = float(raw)
    except ValueError:
        raise ValueError(f"TENSORBUS_COST_PER_HOUR: {raw!r} is not a number") from None
    if not price >= 0:
        raise ValueError(f"TENSORBUS_COST_PER_HOUR: {raw!r} is not a price (>= 0)")
    return price


def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


# TENSORBUS_PREFILL_CHUNK=0: prompt tokens a decoder computes between two decode steps,
# by the device it runs on. On the CPU kernel a prompt costs the same in 128-token
# chunks as in 512-token ones, and running streams wait one chunk between their steps
# (docs/decisions/0076-cpu-prefill-chunk.md); an accelerator's chunks gain from size.
CPU_PREFILL_CHUNK = 128
ACCELERATOR_PREFILL_CHUNK = 512


def prefill_chunk_on(setting: int, device: str) -> int:
    """`setting` (TENSORBUS_PREFILL_CHUNK), or where it is 0 the default on `device`
    ("cpu", "cpu:0", "cuda:0", ...): the worker and the scheduler agree by it."""
    if setting > 0:
        return setting
    return CPU_PREFILL_CHUNK if device.startswith("cpu") else ACCELERATOR_PREFILL_CHUNK
