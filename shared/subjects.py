"""Every NATS subject tensorbus uses, as functions and constants.

Services never spell a subject literally; they call these. Public subjects are the
v1 contract in docs/protocol.md; `tensorbus.v1.*` subjects are internal and may change.
"""

from __future__ import annotations

# Public API (JSON by default, msgpack with Content-Type: application/msgpack).
EMBEDDINGS = "inference.v1.embeddings"
COMPLETIONS = "inference.v1.completions"
CHAT_COMPLETIONS = "inference.v1.chat.completions"
MODELS = "inference.v1.models"
TOKENIZE = "inference.v1.tokenize"
DETOKENIZE = "inference.v1.detokenize"
RERANK = "inference.v1.rerank"
SCORE = "inference.v1.score"
RESPONSES = "inference.v1.responses"
PUBLIC_INFERENCE = (EMBEDDINGS, COMPLETIONS, CHAT_COMPLETIONS, TOKENIZE, DETOKENIZE, RERANK, SCORE,
                    RESPONSES)

# The Files and Batch API (request/reply, the HTTP routes' bodies; docs/protocol.md).
FILE_OPS = ("put", "get", "list", "delete", "content")
BATCH_OPS = ("create", "get", "list", "cancel")


def files(op: str) -> str:
    """`inference.v1.files.<op>`, op one of FILE_OPS (`*`: all of them)."""
    return f"inference.v1.files.{op}"


def batches(op: str) -> str:
    """`inference.v1.batches.<op>`, op one of BATCH_OPS (`*`: all of them)."""
    return f"inference.v1.batches.{op}"


# Telemetry (msgpack records, schemas in shared.telemetry).
TELEMETRY_REQUESTS = "telemetry.v1.requests"
TELEMETRY_WORKERS = "telemetry.v1.workers"
TELEMETRY_SCALE = "telemetry.v1.scale"
TELEMETRY_SUMMARY = "telemetry.v1.summary"
TELEMETRY_ALL = "telemetry.v1.>"
TELEMETRY_STREAM = "TELEMETRY"

# Internal dispatch.
SCHED_SUBMIT = "tensorbus.v1.sched.submit"
"""Gateway -> scheduler (queue group `scheduler`): one WorkRequest."""

SCHED_RESERVE = "tensorbus.v1.sched.reserve"
"""Gateway -> scheduler (queue group `scheduler`, request/reply): Reserve, room for a
large embeddings request before it is tokenized."""

SCHED_LOAD = "tensorbus.v1.sched.load"
"""Scheduler -> all schedulers and gateways: SchedLoad, its outstanding work per model."""

QUEUE_GATEWAY = "gateway"
QUEUE_SCHEDULER = "scheduler"


def sched_submit(scheduler_id: str) -> str:
    """Gateway -> the scheduler that reserved its request's room (`Reserve`)."""
    return f"tensorbus.v1.sched.{scheduler_id}.submit"


def sched_done(scheduler_id: str) -> str:
    """Worker -> the scheduler that dispatched: ids of finished work (WorkDone)."""
    return f"tensorbus.v1.sched.{scheduler_id}.done"


def worker_work(worker_id: str) -> str:
    """Scheduler -> one worker: a WorkRequest to run."""
    return f"tensorbus.v1.worker.{worker_id}.work"


def reply_group(inbox_prefix: str) -> str:
    """Worker -> one gateway: `Results` for several of its requests at once. A token
    under the gateway's reply prefix that no request id takes (those are hex, or
    hold a `-`), so the gateway's one wildcard subscription receives it."""
    return f"{inbox_prefix}.results"


ORCHESTRATOR_STATUS = "tensorbus.v1.orchestrator.status"
"""Local orchestrator -> everyone: FleetStatus (model states, failed models' reasons)."""

CANCEL = "tensorbus.v1.cancel"
"""Broadcast Cancel(request_id): whichever worker holds the request frees it."""


# Registry (JetStream KV and Object Store bucket names).
REGISTRY_OBJECTS = "tensorbus_models"
REGISTRY_META = "tensorbus_registry"
RESPONSES_BUCKET = "tensorbus_responses"  # stored /v1/responses (KV, 24 h TTL)
FILES_BUCKET = "tensorbus_files"  # /v1/files contents (Object Store: raw bytes)
BATCHES_BUCKET = "tensorbus_batches"  # /v1/files and /v1/batches records, batch progress (KV)
