"""Internal wire messages between gateway, scheduler and workers (msgpack).

Compact tagged Structs (`array_like=True, gc=False`), one union per subject, one
typed decoder built once per process. New fields get defaults at the end; a breaking
change gets a new tag.

Times that cross a process are wall-clock UNIX seconds (`time.time()`): a deadline is
an instant every process can compare with its own clock. Durations are measured with
`time.perf_counter()` inside one process and travel as seconds.
"""

from __future__ import annotations

import msgspec


class _Msg(msgspec.Struct, array_like=True, gc=False, tag_field="t", omit_defaults=False):
    pass


GRAMMAR_RELEASE = "tensorbus_release"  # see Sampling.grammar


class Sampling(msgspec.Struct, array_like=True, gc=False):
    """Sampling parameters of one generation request (already validated)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = msgspec.field(default_factory=list)  # (token, bias)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # end a choice as EOS does
    logprobs: int = -1  # top logprobs per token (-1: none; 0: the sampled token's only)
    # Structured outputs: the llguidance grammar (its JSON form) every token must
    # follow, built and validated by the gateway from `response_format` or `tools`;
    # "" = none. A grammar with a capture named GRAMMAR_RELEASE constrains nothing
    # after it: the engine drops the grammar there (docs/decisions/0057).
    grammar: str = ""
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are generated


class EmbedWork(_Msg, tag="embed"):
    """Embed `inputs` (already tokenized) with `model`; with `types`, score them: each
    input is a text pair for a cross-encoder (rerank, score), `types` its token type
    ids, one per token."""

    request_id: str
    model: str
    version: str  # "" = whichever version the alias names; "3" = pinned
    inputs: list[list[int]]
    deadline: float  # UNIX seconds
    reply: str  # where results go (the gateway's inbox for this request)
    sched_id: str = ""
    attempt: int = 0
    user: str = ""  # sticky canary / A-B key: OpenAI's `user`, else the Tensorbus-User header
    group: str = ""  # where the requester takes `Results` (several requests' answers in one
    # message); "" = every answer goes to `reply` on its own
    reserved: str = ""  # the scheduler that admitted it before tokenizing (`Reserve`):
    # admitted there already, not checked again; "" = admitted on arrival
    types: list[list[int]] = msgspec.field(default_factory=list)  # [] = embed; else pairs
    dimensions: int = 0  # Matryoshka: keep the first `dimensions` of each vector
    # (renormalised when the model normalises); 0 = the full width
    priority: int = 0  # its lane at the scheduler (shared.priority): 0 interactive, 1 batch
    raw: bool = False  # pairs: the classifier's logits, before the model's activation
    # (TEI's `raw_scores`); False = the activated scores (CrossEncoder.predict's)


class GenerateWork(_Msg, tag="generate"):
    """Generate from `prompt` (token ids). `n` choices share the prompt."""

    request_id: str
    model: str
    version: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    n: int
    stream: bool
    deadline: float
    reply: str
    sched_id: str = ""
    attempt: int = 0
    ignore_eos: bool = False
    user: str = ""  # sticky canary / A-B key: OpenAI's `user`, else the Tensorbus-User header
    group: str = ""  # as EmbedWork.group
    reserved: str = ""  # as EmbedWork.reserved
    # `deadline` bounds the wait for the first token; once tokens flow, these do:
    stall_s: float = 0.0  # no token for this long ends it (0 = no stall bound)
    end_by: float = 0.0  # UNIX seconds: it ends by then, whatever it produces (0 = no bound)
    prompt_logprobs: int = -1  # echo with logprobs: the prompt's too, with this many top
    # alternatives at each position (-1: none)
    skip: int = 0  # a resumed stream: its first `skip` tokens were delivered already;
    # generated again (the same: greedy or seeded) and not sent
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's)
    include_stop_str_in_output: bool = False  # a matched stop string ends the text (vLLM's)
    resumes: bool = False  # its requester resumes it when its worker is lost: a scheduler
    # tells it (WorkError `worker_lost`) rather than dispatching it again
    priority: int = 0  # as EmbedWork.priority
    # A resumed request with several choices (services.gateway.continuity):
    choices: list[int] = msgspec.field(default_factory=list)  # the choices (by index) to
    # generate; [] = all `n`. Those delivered whole already are left out.
    skips: list[int] = msgspec.field(default_factory=list)  # `skip` of each choice, by
    # index; [] = `skip` for every choice

    def skipped(self, index: int) -> int:
        """Tokens of choice `index` delivered already: generated again, not sent."""
        return self.skips[index] if self.skips else self.skip

    def generated(self) -> list[int]:
        """The choices (by index) this work generates."""
        return list(self.choices) if self.choices else list(range(self.n))


WorkRequest = EmbedWork | GenerateWork


class Timing(msgspec.Struct, array_like=True, gc=False):
    """Where a request's time went inside the worker, in seconds."""

    batch_wait: float = 0.0  # arrival -> its batch closed
    queue: float = 0.0  # batch closed -> compute started
    compute: float = 0.0  # engine time of its batch (or prefill + decode steps)
    ttft: float = 0.0  # generation: arrival -> first token
    itl_mean: float = 0.0  # generation: mean gap between tokens
    batch_size: int = 0
    itl_counts: list[int] = msgspec.field(default_factory=list)  # gaps per telemetry.ITL_BUCKETS


class EmbedResult(_Msg, tag="embed_result"):
    request_id: str
    worker_id: str
    model: str
    version: str
    dim: int
    vectors: bytes  # float32 little-endian, [len(inputs), dim]: embeddings, or a
    # cross-encoder's scores (dim = its labels)
    prompt_tokens: int
    timing: Timing


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """One generated token's logprob and the top ones at its position, best first; a
    prompt token's also its rank there (chat's `prompt_logprobs`; 0: not computed)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)
    rank: int = 0


class GenChunk(_Msg, tag="chunk"):
    """New text for one choice. `finish_reason` set on its last chunk."""

    request_id: str
    index: int
    text: str
    tokens: int  # tokens generated since the choice's previous chunk (all of them, also
    # those whose text is still held back: an incomplete character, a possible stop)
    finish_reason: str | None = None
    attempt: int = 0  # dispatch attempt that produced it (re-dispatch must not mix)
    version: str = ""  # the model version generating this request (every chunk says it)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)  # one per token in
    # `tokens`, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)  # on a
    # choice's first chunk, when asked for: the prompt's tokens after its first
    seq: int = 0  # its number among its choice's chunks of this attempt, from 0: the
    # gateway drops one it has passed on and ends a stream that lost one


class GenDone(_Msg, tag="done"):
    """The request finished: every choice has sent its last chunk."""

    request_id: str
    worker_id: str
    model: str
    version: str
    prompt_tokens: int
    completion_tokens: int
    timing: Timing
    attempt: int = 0


class WorkError(_Msg, tag="error"):
    request_id: str
    status: int
    message: str
    code: str = ""
    retry_after: float | None = None
    worker_id: str = ""
    version: str = ""  # the version that failed it, when a worker did (canary rollback)


class Accepted(_Msg, tag="accepted"):
    """Scheduler -> gateway: the request was dispatched (to `worker_id`). Sent when a
    held request is released, with the time it was held for a cold start."""

    request_id: str
    worker_id: str
    hold_s: float = 0.0


class Held(_Msg, tag="held"):
    """Scheduler -> gateway: no ready worker serves `model` yet; the request waits for
    one (a cold start) until its deadline."""

    request_id: str
    model: str
    until: float = 0.0  # UNIX seconds it is held until: past its deadline when the model's
    # measured cold start needs longer and its end_by allows (0 = its deadline)


WorkResult = EmbedResult | GenChunk | GenDone | WorkError | Accepted | Held


class Results(_Msg, tag="results"):
    """Worker -> one gateway (to the work's `group` subject): every answer one decode
    step or one encoder batch produced for that gateway's requests, in the order they
    were produced. The gateway hands each to its request as if it had come alone."""

    items: list[EmbedResult | GenChunk | GenDone | WorkError]


class WorkDone(_Msg, tag="work_done"):
    """Worker -> its dispatching scheduler: these requests are finished."""

    worker_id: str
    request_ids: list[str]
    compute_s: float = 0.0  # engine seconds of the batch these requests ran in (0 = none)
    tokens: int = 0  # tokens of that whole batch: compute_s / tokens is its cost per token


class ModelLoad(msgspec.Struct, array_like=True, gc=False):
    """One scheduler's outstanding work for one model (dispatched, unfinished, or held)."""

    model: str
    requests: int
    inputs: int
    tokens: int
    cost_per_token: float = 0.0  # its estimate: seconds per token ...
    cost_per_batch: float = 0.0  # ... plus seconds per engine call (both 0 = not measured)
    decode: int = 0  # generation: tokens its sequences may still generate (max_tokens x n)


class SchedLoad(_Msg, tag="sched_load"):
    """Scheduler -> every scheduler and gateway (`tensorbus.v1.sched.load`), every
    heartbeat interval: its share of each model's queue, so they share one bound."""

    scheduler_id: str
    models: list[ModelLoad]
    at: float  # UNIX seconds
    # Times its bus connection dropped: a rise tells the gateways that requests they
    # submitted meanwhile may have been lost with the path, and are submitted again.
    reconnects: int = 0


class Cancel(_Msg, tag="cancel"):
    request_id: str
    reason: str = "cancelled"


class ModelStatus(msgspec.Struct, array_like=True, gc=False):
    """What the local orchestrator knows of one model's workers."""

    model: str
    state: str  # ready | starting | scaled_to_zero | failed
    running: int  # worker processes alive
    desired: int
    reason: str = ""  # why `failed` (a worker's invalid configuration), or ""


class Reserve(_Msg, tag="reserve"):
    """Gateway -> a scheduler (`tensorbus.v1.sched.reserve`, request/reply): admit a
    request before the gateway tokenizes it (a large body: its tokenizing waits behind
    others'), an embeddings request by its estimated size, a completion by count.
    Answered `Reserved`, or a WorkError (the 429 or 503 its submit would get). Several
    gateways' requests meet here, so their bursts share the bound before any
    tokenizing, not after."""

    request_id: str
    model: str
    version: str
    inputs: int  # a completion: its choices (`n`)
    tokens: int  # estimated; 0 for a completion
    deadline: float  # UNIX seconds
    generate: bool = False  # a completion: admitted by count, as its submit would be


class Reserved(_Msg, tag="reserved"):
    """Scheduler -> gateway: room was taken for the request until its work arrives (or
    RESERVATION_S passes). `scheduler_id` "" = nothing reserved (no ready worker: the
    submit's own path decides, a hold or a 503)."""

    request_id: str
    scheduler_id: str


class FleetStatus(_Msg, tag="fleet_status"):
    """Orchestrator -> scheduler and gateway (`tensorbus.v1.orchestrator.status`),
    every interval and at once on a change. A `failed` model gets 503 at once."""

    orchestrator_id: str
    models: list[ModelStatus]
    at: float  # UNIX seconds


encode = msgspec.msgpack.Encoder().encode
work_decoder = msgspec.msgpack.Decoder(WorkRequest)
result_decoder = msgspec.msgpack.Decoder(WorkResult)
results_decoder = msgspec.msgpack.Decoder(Results)
done_decoder = msgspec.msgpack.Decoder(WorkDone)
sched_load_decoder = msgspec.msgpack.Decoder(SchedLoad)
cancel_decoder = msgspec.msgpack.Decoder(Cancel)
fleet_status_decoder = msgspec.msgpack.Decoder(FleetStatus)
reserve_decoder = msgspec.msgpack.Decoder(Reserve)
reserve_reply_decoder = msgspec.msgpack.Decoder(Reserved | WorkError)
