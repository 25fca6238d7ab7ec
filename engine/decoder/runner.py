"""The step runner: the decoder's device work, one call at a time, on the engine thread.

It holds the decode state (the KV pool and each slot's sampling state, donated to
every program, so updated in place) and runs the three kinds of work on it:

  1. `prefill(slot, most)`: the next chunk of a prompt, padded to a length bucket,
     attending to the sequence's blocks through its table and writing its K/V into
     them; the last chunk draws the first token (under its grammar's mask when the
     sequence has one) and the slot goes live (slots.py).
  2. `step()`: one decode step of the live slots only, compacted into the smallest
     compiled batch bucket that holds them (in parts of a smaller one while the
     larger compiles), each reading its own blocks up to the smallest window that
     holds the longest. It returns at once: one [B, 2 + 2K] int32 array per part
     (each row's token, then its logprobs) leaves the device when the caller reads
     `PendingStep.result()`, and only then do the tokens reach the slot table and
     the grammars. The step in flight is `last`.
  3. `mixed(chunks, shape)`: on the CPU kernel, the live slots' decode step and
     prompt chunks of several sequences in one pass of the mixed program's tokens
     (decode rows first, one token each; then the chunks, oldest first, as far as
     the tokens go). It returns at once like `step`; a last chunk's first token is
     in its result like a decode row's, and its slot is in the steps after it.
  4. `verify`, `copy`, `run_form`, `warm`: a speculative pass, a block copy, one
     run of a bucket's measuring shape, one run of a shape at warm-up (the last
     two on the dummy row: no sequence's state or cache is touched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from engine.decoder.compiled import StepPrograms
from engine.decoder.formchoice import FormChoice, measure_shape
from engine.decoder.grammar import SlotGrammars
from engine.decoder.slots import SlotTable


class PendingStep:
    """A dispatched decode step; its tokens leave the device on `result()`."""

    def __init__(self, tokens: Sequence[jax.Array | np.ndarray], rows: np.ndarray, slots: int,
                 on_result: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        # parts x [B, 2 + 2K] int32, on device: row i is slot rows[i]'s token, then its
        # logprobs (engine.decoder.steps.pack)
        self._tokens = tokens
        self._rows = rows  # [parts x B] int32 (padding rows name the dummy row, index SLOTS)
        self._slots = slots
        self._host: np.ndarray | None = None
        self._on_result = on_result
        self.batch = len(rows) // len(tokens)  # the batch bucket it ran at
        # Slot -> its tokens after its entry in `result()`: a speculative step's
        # accepted drafts emit several (engine/decoder/speculative.py).
        self.more: dict[int, list[int]] = {}
        self.prompt_tokens = 0  # prompt tokens its pass computed (a mixed step)

    def result(self) -> np.ndarray:
        """[SLOTS] int32: each slot's token (slots not in the step: ignore)."""
        if self._host is None:
            # The step's one host copy (one per part when it ran in parts).
            packed = np.concatenate([np.asarray(t) for t in self._tokens])
            out = np.zeros((self._slots + 1, packed.shape[1]), np.int32)
            out[self._rows] = packed
            self._host = np.ascontiguousarray(out[: self._slots, 0])
            if self._on_result is not None:
                self._on_result(self._host, out[: self._slots, 1:])
        return self._host


class StepRunner:
    def __init__(self, state, table: SlotTable, programs: StepPrograms, forms: FormChoice,
                 grammar: SlotGrammars, warm_sampling, chunk: int) -> None:
        """state: the decode state (kvcache.DecodeState), placed; warm_sampling: a
        greedy request's sampling arguments (warm-up and measuring runs); chunk:
        the longest prefill piece."""
        self.state = state
        self.table = table
        self.programs = programs
        self.forms = forms
        self.grammar = grammar
        self.chunk = chunk
        self._warm_sampling = warm_sampling
        self._dummy = table.slots  # the padding rows' slot: its table is all scratch
        self.last: PendingStep | None = None  # the step in flight (or last read)

    # ---------------------------------------------------------------- prefill
    def prefill(self, slot: int, most: int = 0) -> int | None:
        """Compute the next chunk of `slot`'s prompt (at most `most` tokens if > 0);
        return the first generated token after the last chunk, else None."""
        job, end = self.table.next_chunk(slot, min(self.chunk, most) if most > 0 else self.chunk)
        bucket, ctx, end = self.programs.prefill_shape(job.done, end)
        mask = self.grammar.first_mask(slot) if end == len(job.prompt) else None
        packed = self._chunk(slot, job.prompt[job.done : end], job.done, bucket, ctx,
                             job.sampling, job.seed, mask)
        token = self.table.prefilled(slot, end, packed)
        if token is not None:
            self.grammar.consume(slot, token)
        return token

    def _chunk(self, slot: int, piece: list[int], offset: int, bucket: int, ctx: int,
               sampling, seed, mask=None) -> jax.Array:
        padded = np.zeros(bucket, np.int32)  # padded: [T]
        padded[: len(piece)] = piece
        table = np.array(self.table.tables[slot, : ctx // self.table.block])  # [NC]
        run = self.programs.get("prefill", bucket, ctx)
        self.state, token = run(
            self.forms.params_for("prefill", bucket), self.state, padded, np.int32(offset),
            np.int32(len(piece)), table, np.int32(slot), sampling, seed,
            self.programs.allowed() if mask is None else mask,  # structured outputs
        )  # fmt: skip
        return token

    def mixed(self, chunks: list[tuple[int, int]], shape: tuple[int, int]) -> PendingStep:
        """Dispatch one mixed step of `shape` (tokens, table rows; compiled, holding
        the live rows): every live slot's decode row, then the next chunk of each
        (slot, at most n tokens; 0: any) in `chunks` while the tokens and rows last.
        A prompt whose last chunk it holds is live from the next step; its first
        token reaches the slot table when this step is read, as a decode row's does."""
        table, programs = self.table, self.programs
        size, width = shape
        live = np.flatnonzero(table.active)
        dummy = self._dummy
        tokens = np.zeros(size, np.int32)
        rows = np.zeros(size, np.int32)  # padding names row 0: at position -1 it reads nothing
        positions = np.full(size, -1, np.int32)
        lengths = np.zeros(size, np.int32)
        decoding = np.zeros(size, bool)
        slots = np.full(width, dummy, np.int32)
        last = np.zeros(width, np.int32)
        commit = np.zeros(width, bool)
        n = len(live)  # decode rows: row i is live slot i, token i
        slots[:n], last[:n], commit[:n] = live, np.arange(n), True
        rows[:n], decoding[:n] = np.arange(n), True
        ends: list[tuple[int, int]] = []  # (slot, where its chunk ends)
        used, row = n, n
        for slot, most in chunks:
            left = size - used
            if left <= 0 or row >= width:
                break
            job, end = table.next_chunk(slot, min(left, most) if most > 0 else left)
            if end == len(job.prompt):  # its first token is drawn here, under the mask
                # of the matcher the engine built when it took the chunk (prefill_step)
                self.state = programs.claim(self.state, np.int32(slot), job.seed, job.sampling)
                commit[row] = True
            k = end - job.done
            tokens[used : used + k] = job.prompt[job.done : end]
            rows[used : used + k] = row
            positions[used : used + k] = np.arange(job.done, end)
            lengths[used : used + k] = end
            slots[row], last[row] = slot, used + k - 1
            ends.append((slot, end))
            used, row = used + k, row + 1
        mask = self.grammar.step_masks(slots, programs.allowed(width))
        run = programs.get("mixed", size, width)
        self.state, packed = run(
            self.forms.params_for("mixed", size), self.state, tokens, rows, positions, lengths,
            decoding, table.tables[slots], slots, last, commit, mask)  # fmt: skip
        table.advance()  # the live rows hold one more token each
        for slot, end in ends:
            table.prefilled(slot, end)  # a last chunk's slot is live from the next step
        drew = slots[commit]  # decode rows and last chunks: their tokens are read with it
        began = table.order[drew].copy()
        pending = PendingStep([packed], slots, table.slots,
                              lambda host, lp: self._note(drew, began, host, lp))
        pending.prompt_tokens = used - n
        self.grammar.dispatched(pending)
        self.last = pending
        programs.mixed_counts[width] = programs.mixed_counts.get(width, 0) + 1
        return pending

    def copy(self, src: int, dst: int) -> None:
        """Block `src`'s K/V into block `dst`, every layer (queued behind the step in flight)."""
        self.state = self.programs.copy(self.state, np.int32(src), np.int32(dst))

    # ------------------------------------------------------------------ decode
    def step(self) -> PendingStep:
        """Dispatch one decode step of the live slots and return at once."""
        table = self.table
        live = np.flatnonzero(table.active)
        began = table.order[live].copy()  # which sequence each live slot held
        batch, window = self.programs.step_shape(len(live), table.window_need(),
                                                 len(table.jobs))  # fmt: skip
        tokens, rows = self._run_step(batch, window)
        pending = PendingStep(tokens, rows, table.slots,
                              lambda host, lp: self._note(live, began, host, lp))
        self.grammar.dispatched(pending)
        table.advance()
        self.last = pending
        return pending

    def _note(self, live, began, host, logprobs) -> None:
        for slot, token in self.table.note(live, began, host, logprobs):
            self.grammar.consume(slot, token)

    def _run_step(self, batch: int, window: int) -> tuple[list[jax.Array], np.ndarray]:
        """One decode step of the live slots at (batch bucket, window), in as many
        parts of `batch` rows as they need (rows are independent: parts compute the
        same tokens as one larger bucket) -> (tokens [B] on device, one array per
        part; rows [parts x B]: the slot of each row, the dummy row for padding)."""
        live = np.flatnonzero(self.table.active)
        parts = max(1, -(-len(live) // batch))
        rows = np.full(parts * batch, self._dummy, np.int32)  # [parts x B]
        rows[: len(live)] = live
        params = self.forms.params_for("step", batch)
        run = self.grammar.step_program(self.programs.get("step", batch, window),
                                        self.programs.allowed(batch), rows)  # fmt: skip
        out = []
        for part in rows.reshape(parts, batch):
            tables = self.table.tables[part, : window // self.table.block]  # [B, NW] (a copy)
            self.state, tokens = run(params, self.state, part, tables, part < self._dummy)
            out.append(tokens)
        if len(live):  # warm-up and measuring runs are not steps
            counts = self.programs.step_counts
            counts[batch] = counts.get(batch, 0) + parts
        return out, rows

    def verify(self, slot: int, fed: np.ndarray, offset: int, length: int, window: int):
        """A speculative pass over `fed` ([T] int32: the last token, then the drafts)."""
        table = np.array(self.table.tables[slot, : window // self.table.block])  # [NW]
        run = self.programs.get("verify", len(fed), window)
        self.state, out = run(self.forms.params_for("verify", len(fed)), self.state, fed,
                              np.int32(offset), np.int32(length), table, np.int32(slot))  # fmt: skip
        return out

    # ----------------------------------------------------- dummy-row runs
    def warm(self, kind: str, size: int, other: int) -> None:
        """Compile (if needed) and run one shape once, on the dummy row."""
        out: jax.Array | list[jax.Array]
        if kind == "prefill":
            out = self._chunk(self._dummy, [0] * size, 0, size, other, self._warm_sampling,
                              np.uint32(0))
        elif kind == "verify":
            out = self.verify(self._dummy, np.zeros(size, np.int32), 0, 1, other)
        elif kind == "mixed":  # nothing live: every token padding, every row the dummy's
            slots = np.full(other, self._dummy, np.int32)
            self.state, out = self.programs.get("mixed", size, other)(
                self.forms.params_for("mixed", size), self.state, np.zeros(size, np.int32),
                np.zeros(size, np.int32), np.full(size, -1, np.int32), np.zeros(size, np.int32),
                np.zeros(size, bool), self.table.tables[slots], slots, np.zeros(other, np.int32),
                np.zeros(other, bool), self.programs.allowed(other))  # fmt: skip
        else:
            out = self._run_step(size, other)[0]
        jax.block_until_ready(out)

    def claim_dummy(self) -> None:
        """Claim the dummy row once: compiles the claim (mixed steps)."""
        self.state = self.programs.claim(self.state, np.int32(self._dummy), np.uint32(0),
                                         self._warm_sampling)  # fmt: skip

    def run_form(self, bucket: str, form: str):
        """One run of `bucket`'s measuring program in `form`, on the dummy row."""
        kind, size, other = measure_shape(self.programs, bucket)
        params, run = self.forms.params_of(form), self.programs.get(kind, size, other, form)
        block = self.table.block
        if kind == "step":
            rows = np.full(size, self._dummy, np.int32)  # [B]: all the dummy row
            tables = self.table.tables[rows, : other // block]  # [B, NW]
            self.state, out = run(params, self.state, rows, tables, rows < self._dummy,
                                  self.programs.allowed(size))  # fmt: skip
            return out
        table = np.array(self.table.tables[self._dummy, : other // block])  # [NC]
        self.state, token = run(params, self.state, np.zeros(size, np.int32), np.int32(0),
                                np.int32(size), table, np.int32(self._dummy),
                                self._warm_sampling, np.uint32(0), self.programs.allowed())  # fmt: skip
        return token
