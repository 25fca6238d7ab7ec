"""The decoder's output processor: tokens in, what to tell the gateway out.

  1. `add()` opens a request's record when it is submitted (its arrival time).
  2. `accept()` takes one new token of one sequence: it is detokenized (never
     splitting a UTF-8 character; `engine.detok.Detokenizer`, one per choice, made
     on its first token) and checked against EOS, `stop_token_ids` (both end the
     choice without their text, as vLLM does), stop strings (none that ends in the
     text of the first `min_tokens` tokens, as in vLLM), `max_tokens` and the
     context, which sets the sequence's `finish`. The gap since the sequence's last
     token is counted for the request's inter-token latency.
  3. A streaming choice gets a GenChunk for each token that made text (or ended
     it); a non-streaming one gets one chunk with its whole text when it ends,
     and meanwhile an empty one (no text, no tokens) at its first token and then
     every quarter of its stall timeout: the gateway's clock learns tokens flow
     (the deadline bounds only the wait for the first; docs/protocol.md).
     When the request asked for logprobs, each token's (read from the engine,
     which got them in the step's one host copy) rides in the chunk that follows it.
     Every chunk names the version whose engine produced it.
  4. `close()` ends a request: a 504 first when it ran out of time (before its
     first token, or stalled, or past its `end_by`; not when cancelled), then
     the GenDone with usage and Timing (queue, compute, ttft, mean ITL, ITL counts).

It calls no engine and awaits nothing: each call returns the messages to send
(`Say`), and the runner's loop publishes them, a step's together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.decode.sequences import Lane, Request, Sequence
from shared.errors import ServiceError, out_of_time
from shared.messages import GenChunk, GenDone, GenerateWork, Timing, TokenLogprob
from shared.telemetry import itl_bucket, itl_counts

if TYPE_CHECKING:
    from engine.detok import Detokenizer


@dataclass(frozen=True)
class Say:
    """One message for the requester of `work`: a ServiceError goes out as its error."""

    work: GenerateWork
    message: GenChunk | GenDone | ServiceError


@dataclass(eq=False)
class Stream:
    """One choice's output so far."""

    detok: Detokenizer
    last_at: float = 0.0  # perf_counter of its latest token
    generated: int = 0
    unsent: int = 0  # tokens generated since its last chunk
    text: list[str] = field(default_factory=list)  # unsent text (non-streaming)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # unsent, when asked for
    noted: float = 0.0  # perf_counter of its latest progress chunk (non-streaming)
    prompt: list[TokenLogprob] = field(default_factory=list)  # echo: rides its first chunk
    sent: int = 0  # chunks sent (the next one's `seq`)


@dataclass(eq=False)
class RequestOutput:
    arrived: float  # perf_counter
    completion_tokens: int = 0
    first_at: float = 0.0  # perf_counter of its first token (0: none yet)
    admitted: float = 0.0  # when the choice that made the first token was admitted
    itl_sum: float = 0.0
    itl_n: int = 0
    itl_counts: list[int] = field(default_factory=itl_counts)  # per-token gaps, bucketed
    streams: dict[int, Stream] = field(default_factory=dict)  # choice index -> stream
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # echo, when asked


class OutputProcessor:
    def __init__(self, worker_id: str, model: str) -> None:
        self.worker_id = worker_id
        self.model = model
        self.requests: dict[str, RequestOutput] = {}

    def add(self, work: GenerateWork, arrived: float, prompt_logprobs=()) -> None:
        """`prompt_logprobs`: the prompt's (echo), for each choice's first chunk."""
        self.requests[work.request_id] = RequestOutput(arrived, prompt_logprobs=list(prompt_logprobs))

    def accept(self, seq: Sequence, tok: int, now: float) -> list[Say]:
        """One token of `seq` (on its lane), read at `now` (perf_counter)."""
        lane = seq.lane
        assert lane is not None  # a sequence with tokens was admitted to a lane
        st = self.requests[seq.work.request_id]
        stream = st.streams.get(seq.index)
        if stream is None:
            stream = st.streams[seq.index] = Stream(_detokenizer(lane.engine, seq.work),
                                                    prompt=st.prompt_logprobs)
        if stream.generated == 0:
            if not st.first_at:
                st.first_at, st.admitted = now, seq.admitted
        else:
            gap = now - stream.last_at
            st.itl_sum += gap
            st.itl_n += 1
            st.itl_counts[itl_bucket(gap)] += 1
        stream.last_at = now
        stream.generated += 1
        stream.unsent += 1
        seq.tokens.append(tok)
        st.completion_tokens += 1
        if seq.work.sampling.logprobs >= 0:
            got = lane.engine.token_logprobs(seq.slot)
            if got is not None:
                stream.logprobs.append(TokenLogprob(tok, got[0], got[1]))
        text = self._check(seq, lane, stream, tok)
        if stream.generated <= seq.work.skipped(seq.index) and not seq.finish:
            # resumed: the gateway delivered these already; the detokenizer has run
            # over them, so the next chunk's text goes on where they stopped
            stream.unsent, stream.logprobs = 0, []
            return []
        if seq.work.stream:
            return [self._chunk(seq, lane, stream, text)] if text or seq.finish else []
        stream.text.append(text)
        if seq.finish:
            return [self._chunk(seq, lane, stream, "".join(stream.text))]
        return self._progress(seq, lane, stream, now)

    @staticmethod
    def _progress(seq: Sequence, lane: Lane, stream: Stream, now: float) -> list[Say]:
        """A non-streaming choice's empty chunk, when the gateway should hear that it
        makes progress: at its first token, then every quarter of its stall timeout."""
        w = seq.work
        if stream.noted and (w.stall_s <= 0 or now - stream.noted < w.stall_s / 4):
            return []
        stream.noted = now
        chunk = GenChunk(w.request_id, seq.index, "", 0, None, w.attempt, lane.version,
                         prompt_logprobs=stream.prompt, seq=stream.sent)
        stream.prompt, stream.sent = [], stream.sent + 1
        return [Say(w, chunk)]

    @staticmethod
    def _check(seq: Sequence, lane: Lane, stream: Stream, tok: int) -> str:
        """Its new text; sets `seq.finish` when this token ends it."""
        detok = stream.detok
        w = seq.work
        if (tok in lane.eos and not w.ignore_eos) or tok in w.sampling.stop_token_ids:
            seq.finish = "stop"
            return detok.flush()
        text = detok.feed(tok)
        in_context = len(seq.work.prompt) + stream.generated  # the slot may be preempted
        if not detok.stopped and (stream.generated >= seq.work.max_tokens
                                  or lane.max_context <= in_context):
            seq.finish = "length"
            text += detok.flush()  # may still complete a stop string
        if detok.stopped:
            seq.finish = "stop"
        return text

    @staticmethod
    def _chunk(seq: Sequence, lane: Lane, stream: Stream, text: str) -> Say:
        w = seq.work
        chunk = GenChunk(w.request_id, seq.index, text, stream.unsent, seq.finish,
                         w.attempt, lane.version, stream.logprobs, stream.prompt, stream.sent)
        stream.unsent, stream.sent = 0, stream.sent + 1
        stream.logprobs, stream.prompt = [], []
        return Say(w, chunk)

    def close(self, req: Request, version: str, running: int, now: float) -> list[Say]:
        """Its last choice ended (`running` sequences still hold slots): an error
        first when it ran out of time, then its GenDone."""
        w = req.work
        st = self.requests.pop(w.request_id, None) or RequestOutput(req.arrived)
        says = []
        if not req.cancelled and req.expired:
            says.append(Say(w, out_of_time(req.expired, w.stall_s)))
        timing = Timing(
            queue=(st.admitted or now) - st.arrived,
            compute=now - (st.admitted or now),
            ttft=(st.first_at - st.arrived) if st.first_at else 0.0,
            itl_mean=st.itl_sum / st.itl_n if st.itl_n else 0.0,
            batch_size=running + 1,
            itl_counts=st.itl_counts if st.itl_n else [])
        says.append(Say(w, GenDone(w.request_id, self.worker_id, self.model, version,
                                   len(w.prompt), st.completion_tokens, timing, w.attempt)))
        return says


def _detokenizer(engine, work: GenerateWork):
    from engine.detok import Detokenizer

    return Detokenizer(engine.info.tokenizer, prompt_ids=work.prompt, stop=work.stop,
                       skip_special_tokens=work.skip_special_tokens,
                       include_stop=work.include_stop_str_in_output,
                       min_tokens=work.sampling.min_tokens)
