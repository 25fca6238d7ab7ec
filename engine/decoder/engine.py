"""Host-side driver of the decoder engine: what a worker calls, from one thread.

Dataflow of a served sequence:
  1. `begin(slot, prompt, sampling, seed)`: the sequence gets blocks from the pool
     for its prompt and first token; full blocks whose prefix is cached are reused
     (their K/V is not computed again), the rest are fresh; a cached block that
     goes on along the prompt is copied into the first fresh one, up to where they
     part (blocks.py). `can_admit` says first whether the pool has them.
  2. `prefill_step(slot, budget)`: one chunk of the prompt (at most
     `prefill_chunk` tokens, from where the reused prefix or the last chunk ended),
     padded to a length bucket, attends to the sequence's blocks and writes its K/V
     into them. The last chunk draws the first token with the request's own seeded
     key and makes the slot live (static.py's `prefill_insert`: 1 and 2 in one call).
  3. `make_room()` then `step()`: a live slot whose next token starts a new block
     gets one; when the pool is dry the newest sequence is preempted (its blocks
     go back, the caller re-runs it later from its tokens so far). Then one
     compiled decode step for the live slots only, compacted into the smallest
     batch bucket that holds them (a slot is a place in the pool, not a row of
     every step: one stream pays for one row), each reading its own blocks through
     its table up to the smallest window that holds the longest; the state is
     donated, so the pool is updated in place; one [B, 2 + 2K] int32 array (each
     row's token, then its logprobs when a sequence asked for them) comes back to
     the host, spread back to [SLOTS] there.
  4. The caller decides when a sequence ends (EOS, stop string, max tokens,
     `context_left(slot) == 0`) and calls `free(slot)`: its blocks go back to the
     pool; its full blocks stay cached (LRU) for the next prompt that shares them,
     generated tokens included (the engine notes each token it hands out), so a
     conversation's next turn reuses the previous answer as well as its prompt.

Compiles: one per (prefill bucket, context window it may attend to) plus one per
(decode batch bucket, attention window). `warmup()` compiles what a first request
needs (engine/decoder/programs.py) and, with `background=True`, the rest on a
thread of its own, cheapest first; until a shape is compiled the smallest compiled
one that holds the work stands in (a larger batch bucket or window computes the
same tokens). Every per-request value (slot, offset, length, block table, seed,
sampling) is traced. A quantized engine runs each bucket in its own compute form,
measured after ready when no choice is stored (engine/decoder/formchoice.py); a
program's key names its form.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import weakref
from pathlib import Path

import jax
import numpy as np

from engine.decoder import attention as attention_kernel
from engine.decoder import steps
from engine.decoder import shapes
from engine.decoder.shapes import i32
from engine.decoder.config import load_config
from engine.decoder.formchoice import FormChoice
from engine.decoder.kvcache import (
    SlotSampling,
    block_bytes,
    cache_bytes,
    init_decode_state,
)
from engine.decoder.programs import Programs, lower_weakly
from engine.decoder.slots import PendingStep, slot_sampling
from engine.decoder.speculative import SpeculativeSlots
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger(__name__)
DEFAULT_BUCKETS = (1, 16, 32, 64, 128, 256, 512)
COMPILE_AHEAD = ("all", "first", "lazy")
GREEDY = Sampling(temperature=0.0)


class DecoderEngine(FormChoice, SpeculativeSlots):
    def __init__(
        self,
        model_dir: str | Path,
        name: str,
        dtype: str = "float32",
        slots: int = 16,
        max_context: int = 512,
        prefill_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        decode_windows: tuple[int, ...] | None = None,
        kv_block: int = 16,
        kv_blocks: int = 0,
        prefill_chunk: int = 0,
        prefix_cache: bool = True,
        tensor_parallel: int = 1,
        quant: str = "none",
        quant_form: str = "auto",
        weight_budget: int = 0,
        forms_cache: str | Path | None = "",
        weights_cache: str | Path | None = "",
        compile_ahead: str = "lazy",
        attention: str = "auto",
        speculative: int = 0,
    ) -> None:
        """kv_blocks: pool size (0: every slot can hold a full context); prefill_chunk:
        longest prefill piece (0: the largest bucket). quant_form: auto (the fastest
        allowed per bucket, chosen at `warmup`) or one of engine/forms.py's; weight_budget:
        bytes all held forms' weights may take (0: float32 size); forms_cache: the
        choice's file ("": beside the compilation cache; None: not kept); weights_cache:
        the prepared weights' folder (engine/prepared.py), "" and None alike.
        compile_ahead: what `warmup` compiles before it returns: "all", or what a first
        request needs, the rest on a background thread ("first") or where first needed
        ("lazy": tests and benchmarks). attention: the decode step's paged attention
        (engine/decoder/attention.py). speculative: draft tokens per step of a lone
        stream's prompt-lookup speculation (engine/decoder/speculative.py; 0: off)."""
        from engine import forms, sharding
        from engine.jaxrt import device_name, dtype_name, parse_dtype
        from engine.quant import check_mode

        t0 = time.perf_counter()
        if compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"compile_ahead {compile_ahead!r}: use one of {', '.join(COMPILE_AHEAD)}")
        self.compile_ahead = compile_ahead
        self.quant = check_mode(quant)
        self.quant_form = forms.check_form(quant_form, self.quant)
        tp = sharding.parse(tensor_parallel)
        cfg = load_config(model_dir)
        if tp > 1:
            sharding.check_divisible(name, tp, query_heads=cfg.heads, kv_heads=cfg.kv_heads,
                                     mlp_columns=cfg.intermediate)  # fmt: skip
        self._mesh = sharding.make_mesh(tp)
        self.devices = sharding.engine_devices(self._mesh)  # e.g. ["cpu:0", "cpu:1"]
        cfg = dataclasses.replace(cfg, tensor_parallel=tp)
        super().__init__(model_dir, name, cfg, dtype_name(dtype), slots, max_context)
        self._jdtype = parse_dtype(dtype)
        self.block = int(kv_block)
        self.windows = shapes.decode_windows(decode_windows, self._max_context, self.block)
        self.batches = shapes.decode_batches(self._slots)
        self._max_blocks = self.windows[-1] // self.block  # table width: a full context
        chunk = int(prefill_chunk) or max(prefill_buckets)
        self.chunk = min(chunk, self.windows[-1])
        self.buckets = shapes.prefill_buckets(tuple(prefill_buckets), self.chunk)
        # Contexts a prefill chunk may attend to: every other decode window and the
        # largest (fewer compiles; a chunk reads at most one step up).
        ctx = [w for i, w in enumerate(reversed(self.windows)) if i % 2 == 0]
        self.contexts = tuple(sorted(ctx))
        self.device = device_name()
        self.attention = attention_kernel.pick(attention, jax.devices()[0].platform)
        self._load_forms(weight_budget, forms_cache, weights_cache)
        blocks = int(kv_blocks) or self._slots * self._max_blocks + 1
        self._init_slots(blocks, prefix_cache)
        self._state = init_decode_state(self.cfg, self._slots, blocks, self.block, self._jdtype)
        self._warm_sampling = slot_sampling(GREEDY, self.cfg.vocab_size, [])  # warm-up, lowering
        # Sharded: the state keeps its layout across calls (the KV pool split by KV
        # head, the rest replicated), so each step's output is the next step's input
        # as is.
        out = {}
        if self._mesh is not None:
            state_sharding = sharding.state_sharding(self._state, self._mesh)
            self._state = jax.device_put(self._state, state_sharding)
            out = {"out_shardings": (state_sharding, sharding.replicated(self._mesh))}
        cfg = self.cfg
        # state is the argument after params in both: donated, so updated in place.
        self._prefill = jax.jit(lambda params, state, *args: steps.prefill_chunk(
            params, cfg, state, *args), donate_argnums=1, **out)  # fmt: skip
        # The Pallas kernel is written for GPUs; elsewhere it runs interpreted (tests).
        kernel, interpret = self.attention, jax.devices()[0].platform == "cpu"
        self._generate = jax.jit(lambda params, state, *args: steps.generate(
            params, cfg, state, *args, kernel, interpret), donate_argnums=1, **out)  # fmt: skip
        self._copy = jax.jit(steps.copy_block, donate_argnums=0,
                             **({"out_shardings": out["out_shardings"][0]} if out else {}))
        self._state_spec = shapes.spec(self._state)
        self._init_speculation(speculative, out)
        self.programs = Programs(name)
        self.step_counts: dict[int, int] = {}  # batch bucket -> decode steps run at it
        self.weight_bytes = forms.held_bytes(self._forms)
        log.info(
            "decoder_loaded", model=name, family=self.cfg.family, dtype=self._dtype,
            quant=self.quant, forms=list(self._forms), devices=self.devices,
            slots=self._slots, max_context=self._max_context, buckets=list(self.buckets),
            windows=list(self.windows), batches=list(self.batches), attention=self.attention,
            contexts=list(self.contexts), kv_block=self.block, kv_blocks=blocks,
            speculative=self.spec_k, param_bytes=self.weight_bytes,
            cache_bytes=cache_bytes(self._state), seconds=round(time.perf_counter() - t0, 3),
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.cfg, self.block, self._jdtype)

    # ----------------------------------------------------------------- warmup
    @property
    def compiles(self) -> list[tuple[str, int, int]]:
        """Every shape served: (prefill, bucket, context) and (step, batch, window),
        cheapest first within each kind."""
        pre = [("prefill", b, c) for c in self.contexts for b in self.buckets if c >= b]
        step = sorted((("step", b, w) for b in self.batches for w in self.windows),
                      key=lambda k: (k[1] * k[2], k[1]))  # fmt: skip
        return pre + step + self._verify_compiles()

    def first_compiles(self) -> list[tuple[str, int, int]]:
        """What a first request needs: one stream's step at the smallest window, the
        smallest and largest prefill buckets at the smallest context (the largest
        stands in for those between until they join: each costs ~1 s even cached)."""
        c0 = self.contexts[0]
        ends = sorted({self.buckets[0], max(b for b in self.buckets if b <= c0)})
        return [("step", 1, self.windows[0])] + [
            ("prefill", b, c0) for b in ends] + self._verify_compiles()[:1]

    def warmup(self, progress: bool = True) -> int:
        """Compile what `compile_ahead` says (engine/decoder/programs.py) and run it
        once; return how many programs were compiled here."""
        from tqdm import tqdm

        background = self.compile_ahead == "first"
        measuring = self._start_forms() if self.quant != "none" else []
        jobs = self.compiles if self.compile_ahead == "all" else self.first_compiles()
        bar = tqdm(jobs, desc=f"compile {self.name}", file=sys.stderr, disable=not progress)
        t0 = time.perf_counter()
        for kind, size, other in bar:
            bar.set_postfix_str(f"{kind} {size} {other}")
            if kind == "prefill":
                # The dummy row: its table is all scratch, its state row nobody's.
                jax.block_until_ready(self._run_chunk(self._slots, [0] * size, 0, size, other,
                                                      self._warm_sampling, np.uint32(0)))
            elif kind == "verify":  # the dummy row again
                jax.block_until_ready(self._run_verify(self._slots, [0] * size, 0, 1, other))
            else:
                jax.block_until_ready(self._run_step(size, other)[0])
        self._copy_block(0, 0)  # the scratch block onto itself: compiles the copy
        if self.compile_ahead != "lazy" and (background or measuring):
            # One stream at every window first (any load runs on those, in parts),
            # then the programs the forms are measured with (formchoice.py), then the
            # prompts' shapes, then the rest, cheapest first.
            done = set(jobs)
            ones = [k for k in self.compiles if k[0] == "step" and k[1] == 1]
            head = [(k, None) for k in ones if k not in done] if background else []
            tail = [(k, None) for k in self.compiles
                    if k not in done and k not in set(ones)] if background else []  # fmt: skip
            self._compile_background(head + measuring + tail)
        log.info("decoder_warm", model=self.name, compiled=len(jobs), background=background,
                 total=len(self.compiles), measuring=len(measuring),
                 seconds=round(time.perf_counter() - t0, 3))
        return len(jobs)

    def _compile_background(self, shapes: list, first: bool = False) -> None:
        """Compile (shape, form) pairs on the background thread (form None: the one
        its bucket runs now); `first`: ahead of those waiting."""
        ref = weakref.ref(self)  # the thread holds the engine weakly: a dropped version stops
        jobs = []
        for shape, form in shapes:
            form = form or self.compute_forms[self._form_bucket(*shape[:2])]
            jobs.append((self._key(*shape, form=form),
                         functools.partial(lower_weakly, ref, shape, form)))
        self.programs.start_background(jobs, first=first)

    def compile_progress(self) -> tuple[int, int]:
        """(programs compiled, programs this engine serves; the measuring programs of
        its compute forms too while it measures them)."""
        return self.programs.compiled, max(self.programs.total, len(self.compiles))

    def prepare_grammars(self) -> None:
        self.grammar.prepare_background()

    def compile_wait(self) -> tuple[bool, float]:
        """(a step waits on a program being compiled now, seconds steps waited on
        compiles since start), structured outputs' masked twins included."""
        masked = self.grammar.built
        both = [self.programs] + ([masked.programs] if masked is not None else [])
        return any(p.waited_on for p in both), sum(p.waited_s for p in both)

    def on_compiled(self, callback) -> None:
        self.programs.listeners.append(callback)

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop compiling in the background (the engine is being dropped, or its
        process exits); `wait_s`: wait that long for the program being compiled.
        False: one still was. A process must not exit while XLA compiles on the
        daemon thread: the interpreter's exit unwinds that thread through C++ frames
        and the process aborts (SIGABRT) instead of exiting 0."""
        self.programs.stop()
        return self.programs.wait_background(wait_s) if wait_s > 0 else not self.programs.compiling

    # ------------------------------------------------------------- programs
    def _key(self, kind: str, size: int, other: int, form: str | None = None):
        return (kind, size, other, form or self.compute_forms[self._form_bucket(kind, size)])

    def _lowering(self, kind: str, size: int, other: int, form: str | None = None):
        """A function that lowers the program of one shape (not called here), in
        `form` (default: the one its bucket runs)."""
        form = form or self.compute_forms[self._form_bucket(kind, size)]
        if form not in self._forms:  # dropped while it waited in the background
            raise ValueError(f"compute form {form!r} is no longer held")
        params = self._forms[form]
        if kind == "verify":
            return self._verify_lowering(params, size, other)
        if kind == "step":
            args = (i32(size), i32(size, other // self.block), jax.ShapeDtypeStruct((size,), bool))
            return lambda: self._generate.lower(params, self._state_spec, *args)
        u32 = jax.ShapeDtypeStruct((), np.uint32)
        args = (i32(size), i32(), i32(), i32(other // self.block), i32(),
                jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                             self._warm_sampling), u32)  # fmt: skip
        return lambda: self._prefill.lower(params, self._state_spec, *args)

    def _program(self, kind: str, size: int, other: int, form: str | None = None):
        return self.programs.get(self._key(kind, size, other, form),
                                 self._lowering(kind, size, other, form))

    def _choose(self, kind: str, size: int, other: int) -> tuple[int, int]:
        """The compiled shape that holds (size, other) at the least cost, or the exact
        one (compiled where it is first needed) when none is."""
        best = (size, other)
        cost = None
        for key in self.programs.keys():
            k, s, o, form = key
            if (k == kind and s >= size and o >= other
                    and form == self.compute_forms[self._form_bucket(k, s)]
                    and (cost is None or s * o < cost)):
                best, cost = (s, o), s * o
        return best

    # -------------------------------------------------------------- requests
    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def context_for(self, tokens: int) -> int:
        return next(c for c in self.contexts if c >= tokens)

    def prefill_step(self, slot: int, budget: int = 0) -> int | None:
        """Compute the next chunk of `slot`'s prompt (at most `budget` tokens if > 0);
        return the first generated token after the last chunk, else None."""
        job = self._jobs[slot]
        n = min(len(job.prompt) - job.done, self.chunk, budget if budget > 0 else self.chunk)
        end = job.done + n
        bucket = self.bucket_for(n)
        bucket, ctx = self._choose("prefill", bucket, self.context_for(max(end, bucket)))
        mask = self.grammar.first_mask(slot) if end == len(job.prompt) else None
        token = self._run_chunk(slot, job.prompt[job.done : end], job.done, bucket, ctx,
                                job.sampling, job.seed, mask)
        return self._prefilled(slot, end, token)

    def _copy_block(self, src: int, dst: int) -> None:
        self._state = self._copy(self._state, np.int32(src), np.int32(dst))

    def _run_chunk(self, slot: int, piece: list[int], offset: int, bucket: int, ctx: int,
                   sampling: SlotSampling, seed, mask=None) -> jax.Array:
        padded = np.zeros(bucket, np.int32)  # padded: [T]
        padded[: len(piece)] = piece
        table = np.array(self._tables[slot, : ctx // self.block])  # [NC]
        run = (self._program("prefill", bucket, ctx) if mask is None
               else self.grammar.prefill_program(bucket, ctx, mask))  # structured outputs
        self._state, token = run(
            self._params_for(f"prefill {bucket}"), self._state, padded, np.int32(offset),
            np.int32(len(piece)), table, np.int32(slot), sampling, seed,
        )  # fmt: skip
        return token

    # ------------------------------------------------------------------ decode
    def _run_step(self, batch: int, window: int) -> tuple[list[jax.Array], np.ndarray]:
        """One decode step of the live slots at (batch bucket, window), in as many
        parts of `batch` rows as they need (rows are independent: parts compute the
        same tokens as one larger bucket) -> (tokens [B] on device, one array per
        part; rows [parts x B]: the slot of each row, the dummy row for padding)."""
        live = np.flatnonzero(self._active)
        parts = max(1, -(-len(live) // batch))
        rows = np.full(parts * batch, self._slots, np.int32)  # [parts x B]
        rows[: len(live)] = live
        params, run = self._params_for(f"step {batch}"), self._program("step", batch, window)
        run = self.grammar.step_program(run, batch, window, rows)  # itself when unconstrained
        out = []
        for part in rows.reshape(parts, batch):
            tables = self._tables[part, : window // self.block]  # [B, NW] (a copy)
            self._state, tokens = run(params, self._state, part, tables, part < self._slots)
            out.append(tokens)
        if len(live):  # warm-up and measuring runs are not steps
            self.step_counts[batch] = self.step_counts.get(batch, 0) + parts
        return out, rows

    def _step_shape(self, live: int, window: int) -> tuple[int, int]:
        """(batch bucket, window) of the next step: the cheapest compiled shape that
        holds it; else, while the background compiles, the largest compiled bucket at
        a window that holds it, run in parts; else the exact shape, compiled now."""
        batch, window = self._choose("step", self.batch_for(live), window)
        if self.programs.has(self._key("step", batch, window)) or not self.programs.compiling:
            return batch, window
        parts = [(s, o) for k, s, o, form in self.programs.keys()
                 if k == "step" and o >= window and s < batch
                 and form == self.compute_forms[f"step {s}"]]  # fmt: skip
        return max(parts, key=lambda p: (p[0], -p[1])) if parts else (batch, window)

    def batch_for(self, live: int) -> int:
        return next(b for b in self.batches if b >= live)

    def window_for(self) -> int:
        """Smallest attention window that holds every active slot's next position."""
        need = int(self._lengths[self._active].max()) if self._active.any() else 1
        return next(w for w in self.windows if w >= need)

    def step_async(self) -> "PendingStep":
        """Dispatch one decode step and return at once; `.result()` waits for it.

        Lets a caller do host work (detokenize, publish) while the device computes.
        Calls made before `.result()` queue behind the step on the device, so a slot
        inserted meanwhile is not part of this step: ignore its entry in the result.
        Live slots get the blocks they write into first (`make_room`); a caller that
        must re-run preempted sequences calls `make_room()` itself beforehand, or reads
        them from the returned step's `preempted`.
        """
        preempted = self.make_room()
        if (done := self._speculate(preempted)) is not None:
            return done
        live = np.flatnonzero(self._active)
        began = self._order[live].copy()  # which sequence each live slot held
        batch, window = self._step_shape(len(live), self.window_for())
        tokens, rows = self._run_step(batch, window)
        pending = PendingStep(tokens, rows, self._slots, preempted,
                              lambda host, lp: self._note(live, began, host, lp))
        self.grammar.dispatched(pending)
        self._advance()
        self._last_step = pending
        return pending

