"""Continuous batching for decoders: every engine step is one decode for all slots.

  1. `submit()` turns a GenerateWork with `n` choices into `n` sequences waiting FIFO.
  2. Each iteration first retires sequences that finished, were cancelled or expired
     (their slots free within one step), then admits at most `prefill_per_step`
     waiting sequences into free slots (bounded, so running decodes never stall for
     long behind a burst of prompts).
  3. One engine call per iteration, on the engine thread: the admissions' prefills,
     then the tokens of the step dispatched last time, then the next step is
     dispatched (`step_async`) before returning — so detokenizing and publishing
     step n overlap the computation of step n+1. A sequence admitted now joins the
     step after the one in flight; tokens from steps it was not part of are ignored.
  4. New tokens are detokenized per sequence (never splitting a UTF-8 character),
     checked against EOS, stop strings, `max_tokens` and the context, and streamed to
     the gateway as GenChunks (non-streaming requests get one chunk per choice at the
     end). When every choice of a request is done, a GenDone carries usage and timing.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field

from shared.errors import ServiceError, deadline_exceeded, internal
from shared.logging import get_logger
from shared.messages import GenChunk, GenDone, GenerateWork, Timing, encode

log = get_logger("worker.generation")


@dataclass
class Sequence:
    work: GenerateWork
    index: int  # choice index within the request
    seed: int
    arrived: float  # perf_counter
    detok: object
    slot: int = -1
    admitted: float = 0.0
    joined: int = 0  # number of the first decode step that includes it
    first_at: float = 0.0
    last_at: float = 0.0
    generated: int = 0
    text: list[str] = field(default_factory=list)  # unsent text (non-streaming)
    finish: str | None = None


@dataclass
class RequestState:
    work: GenerateWork
    arrived: float
    remaining: int
    completion_tokens: int = 0
    cancelled: bool = False
    first_at: float = 0.0
    itl_sum: float = 0.0
    itl_n: int = 0
    admitted: float = 0.0


class GenerationLoop:
    def __init__(self, worker) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.nc = worker.nc
        self.slots = self.engine.slots
        self.per_step = max(1, worker.config.prefill_per_step)
        self.waiting: deque[Sequence] = deque()
        self.active: dict[int, Sequence] = {}  # slot -> sequence
        self.requests: dict[str, RequestState] = {}
        self.steps = 0
        self._pending = None  # the dispatched decode step, not yet read
        self._dispatched = 0  # decode steps dispatched so far (the pending one's number)
        self._occ_sum = 0
        self._occ_n = 0
        self._wake = asyncio.Event()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._cancel_sub = None
        self._eos = set(self.engine.eos_token_ids)

    # ------------------------------------------------------------- accounting
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> int:
        return len(self.active)

    def occupancy(self) -> float:
        if not self._occ_n:
            return len(self.active) / self.slots
        occ = self._occ_sum / (self._occ_n * self.slots)
        self._occ_sum = self._occ_n = 0
        return occ

    def kv_usage(self) -> float:
        return float(self.engine.kv_usage)

    # -------------------------------------------------------------- requests
    def submit(self, work: GenerateWork) -> None:
        now = time.perf_counter()
        try:
            self.engine.check_prompt(work.prompt)
        except ValueError as exc:
            asyncio.get_running_loop().create_task(self._refuse(work, ServiceError(400, str(exc))))
            return
        self.requests[work.request_id] = RequestState(work, now, work.n)
        base = work.sampling.seed if work.sampling.seed is not None else random.getrandbits(32)
        for i in range(work.n):
            self.waiting.append(Sequence(work, i, (base + i) % 2**32, now, self._detok(work)))
        self._idle.clear()
        self._wake.set()

    def _detok(self, work: GenerateWork):
        from engine.detok import Detokenizer

        return Detokenizer(self.engine.tokenizer, prompt_ids=work.prompt, stop=work.stop)

    def cancel(self, request_id: str) -> None:
        st = self.requests.get(request_id)
        if st is not None:
            st.cancelled = True
            self._wake.set()

    async def _refuse(self, work: GenerateWork, err: ServiceError) -> None:
        await self.worker.send_error(work, err)
        await self.worker.report_done({work.sched_id: [work.request_id]})

    async def drain(self) -> None:
        self._draining = True
        self._wake.set()
        await self._idle.wait()

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        from shared import subjects
        from shared.messages import cancel_decoder

        async def on_cancel(msg) -> None:
            try:
                self.cancel(cancel_decoder.decode(msg.data).request_id)
            except Exception:  # noqa: BLE001 - a bad cancel message is ignored
                pass

        self._cancel_sub = await self.nc.subscribe(subjects.CANCEL, cb=on_cancel)
        loop = asyncio.get_running_loop()
        while True:
            await self._retire()
            if not self.active and not self.waiting and self._pending is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            admits = self._admissions()
            firsts, tokens, step_no = await loop.run_in_executor(
                self.worker.executor, self._engine_step, admits)
            self.steps += 1
            self._occ_sum += len(self.active)
            self._occ_n += 1
            now = time.perf_counter()
            await self._advance(firsts, tokens, step_no, now)

    def _admissions(self) -> list[Sequence]:
        free = [s for s in range(self.slots) if s not in self.active]
        out = []
        now_wall = time.time()
        while self.waiting and free and len(out) < self.per_step:
            seq = self.waiting.popleft()
            st = self.requests.get(seq.work.request_id)
            if st is None or st.cancelled or seq.work.deadline <= now_wall:
                self._finish_unstarted(seq, st)
                continue
            seq.slot = free.pop(0)
            seq.admitted = time.perf_counter()
            self.active[seq.slot] = seq
            out.append(seq)
        return out

    def _engine_step(self, admits: list[Sequence]):
        """Runs on the engine thread: prefills, read the step in flight, dispatch the next."""
        firsts = []
        for seq in admits:
            try:
                firsts.append(self.engine.prefill_insert(
                    seq.slot, seq.work.prompt, seq.work.sampling, seq.seed))
            except Exception as exc:  # noqa: BLE001 - fails this sequence only
                firsts.append(exc)
            # Queued behind the step in flight: it joins the next one dispatched.
            seq.joined = self._dispatched + 1
        pending, step_no = self._pending, self._dispatched
        tokens = pending.result() if pending is not None else None
        if self.engine.active_slots:
            self._pending = self.engine.step_async()
            self._dispatched += 1
        else:
            self._pending = None
        return list(zip(admits, firsts)), tokens, step_no

    async def _advance(self, firsts, tokens, step_no: int, now: float) -> None:
        for seq, tok in firsts:
            if isinstance(tok, Exception):
                log.error("prefill_failed", request_id=seq.work.request_id, error=repr(tok))
                seq.finish = "error"
                st = self.requests.get(seq.work.request_id)
                if st is not None and not st.cancelled:
                    st.cancelled = True  # its other choices stop too
                    await self.worker.send_error(seq.work, internal("the model failed on this prompt"))
                continue
            await self._accept(seq, int(tok), now)
        if tokens is not None:
            for slot, seq in list(self.active.items()):
                if seq.finish is not None or seq.joined > step_no or seq.generated == 0:
                    continue
                await self._accept(seq, int(tokens[slot]), now)

    async def _accept(self, seq: Sequence, tok: int, now: float) -> None:
        st = self.requests[seq.work.request_id]
        if seq.generated == 0:
            seq.first_at = now
            if not st.first_at:
                st.first_at = now
                st.admitted = seq.admitted
        else:
            st.itl_sum += now - seq.last_at
            st.itl_n += 1
        seq.last_at = now
        seq.generated += 1
        st.completion_tokens += 1
        if tok in self._eos and not seq.work.ignore_eos:
            seq.finish = "stop"
            text = seq.detok.flush()
        else:
            text = seq.detok.feed(tok)
            if not seq.detok.stopped and (seq.generated >= seq.work.max_tokens
                                          or self.engine.context_left(seq.slot) <= 0):
                seq.finish = "length"
                text += seq.detok.flush()  # may still complete a stop string
            if seq.detok.stopped:
                seq.finish = "stop"
        if seq.work.stream:
            if text or seq.finish:
                await self._chunk(seq, text)
        else:
            seq.text.append(text)
            if seq.finish:
                await self._chunk(seq, "".join(seq.text))

    async def _chunk(self, seq: Sequence, text: str) -> None:
        w = seq.work
        await self.nc.publish(w.reply, encode(GenChunk(
            w.request_id, seq.index, text, 1, seq.finish, w.attempt)))

    def _finish_unstarted(self, seq: Sequence, st: RequestState | None) -> None:
        seq.finish = "cancelled"
        if st is not None:
            st.remaining -= 1
            if st.remaining == 0:
                asyncio.get_running_loop().create_task(self._close_request(st))

    async def _retire(self) -> None:
        """Free the slots of finished, cancelled and expired sequences."""
        now_wall = time.time()
        for slot, seq in list(self.active.items()):
            st = self.requests.get(seq.work.request_id)
            if seq.finish is None and st is not None and (st.cancelled or seq.work.deadline <= now_wall):
                seq.finish = "cancelled"
            if seq.finish is None:
                continue
            await asyncio.get_running_loop().run_in_executor(
                self.worker.executor, self.engine.free, slot)
            del self.active[slot]
            if st is not None:
                st.remaining -= 1
                if st.remaining == 0:
                    await self._close_request(st)

    async def _close_request(self, st: RequestState) -> None:
        w = st.work
        self.requests.pop(w.request_id, None)
        if st.cancelled or (w.deadline <= time.time() and st.remaining == 0 and not st.first_at):
            if not st.cancelled:
                await self.worker.send_error(w, deadline_exceeded())
        end = time.perf_counter()
        timing = Timing(
            queue=(st.admitted or end) - st.arrived,
            compute=end - (st.admitted or end),
            ttft=(st.first_at - st.arrived) if st.first_at else 0.0,
            itl_mean=st.itl_sum / st.itl_n if st.itl_n else 0.0,
            batch_size=len(self.active) + 1)
        await self.nc.publish(w.reply, encode(GenDone(
            w.request_id, self.worker.id, self.worker.model, self.worker.versions[0],
            len(w.prompt), st.completion_tokens, timing, w.attempt)))
        await self.worker.report_done({w.sched_id: [w.request_id]})
