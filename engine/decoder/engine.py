"""Host-side driver of the decoder engine: what a worker calls, from one thread.

Dataflow of a served sequence:
  1. `begin(slot, prompt, sampling, seed)`: the sequence gets blocks from the pool
     for its prompt and first token; full blocks whose prefix is cached are reused
     (their K/V is not computed again), the rest are fresh. `can_admit` says first
     whether the pool has them.
  2. `prefill_step(slot, budget)`: one chunk of the prompt (at most
     `prefill_chunk` tokens, from where the reused prefix or the last chunk ended),
     padded to a length bucket, attends to the sequence's blocks and writes its K/V
     into them. The last chunk draws the first token with the request's own seeded
     key and makes the slot live. (`prefill_insert` does 1 and 2 in one call.)
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
sampling) is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable
import weakref
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from engine.decoder import attention as attention_kernel
from engine.decoder import steps
from engine.decoder.blocks import SCRATCH, BlockPool, prefix_keys
from engine.decoder.config import DecoderConfig, load_config
from engine.decoder.kvcache import (
    MAX_BIAS,
    DecodeState,
    SlotSampling,
    block_bytes,
    cache_bytes,
    init_decode_state,
)
from engine.decoder.model import param_bytes
from engine.decoder.programs import Programs
from engine.decoder.sampling import MAX_LOGPROBS
from engine.interface import CacheStats
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger(__name__)
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
COMPILE_AHEAD = ("all", "first")
GREEDY = Sampling(temperature=0.0)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _windows(requested: tuple[int, ...] | None, max_context: int, block: int) -> tuple[int, ...]:
    """Attention windows of the decode step (whole blocks): powers of two from 128,
    and the context."""
    if requested is None:
        requested = tuple(2**i for i in range(7, 16))
    top = _round_up(max_context, block)
    return tuple(sorted({_round_up(w, block) for w in requested if 0 < w < max_context} | {top}))


def _batches(slots: int) -> tuple[int, ...]:
    """Decode batch buckets: powers of two below the slot count, and the slot count."""
    return tuple(sorted({2**i for i in range(16) if 2**i < slots} | {slots}))


def _spec(tree):
    """Shapes, dtypes and placements of a pytree: what lowering needs, without
    holding (or reading) buffers a step may have donated meanwhile."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)  # fmt: skip


def _buckets(requested: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Prefill lengths up to the chunk, and always the chunk (the longest piece)."""
    return tuple(sorted({b for b in requested if 0 < b < chunk} | {chunk}))


@dataclass
class _Prefill:
    """A sequence between `begin` and its last prefill chunk."""

    prompt: list[int]
    done: int  # prompt tokens whose K/V is in its blocks (a reused prefix counts)
    sampling: SlotSampling
    seed: np.uint32
    keys: list[bytes]  # prefix keys of the prompt's full blocks


class PendingStep:
    """A dispatched decode step; its tokens leave the device on `result()`."""

    def __init__(self, tokens: jax.Array, rows: np.ndarray, slots: int, preempted: list[int],
                 on_result: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        self._tokens = tokens  # [B, 2 + 2K] int32, on device: row i is slot rows[i]'s
        # token, then its logprobs (engine.decoder.steps.pack)
        self._rows = rows  # [B] int32 (padding rows name the dummy row, index SLOTS)
        self._slots = slots
        self._host: np.ndarray | None = None
        self._on_result = on_result
        self.preempted = preempted  # slots freed to make room before it (not in it)
        self.batch = len(rows)  # the batch bucket it ran at

    def result(self) -> np.ndarray:
        """[SLOTS] int32: each slot's token (slots not in the step: ignore)."""
        if self._host is None:
            packed = np.asarray(self._tokens)  # the step's one host copy
            out = np.zeros((self._slots + 1, packed.shape[1]), np.int32)
            out[self._rows] = packed
            self._host = np.ascontiguousarray(out[: self._slots, 0])
            if self._on_result is not None:
                self._on_result(self._host, out[: self._slots, 1:])
        return self._host


def _state_sharding(state: DecodeState, mesh) -> DecodeState:
    from engine import sharding

    kv, rep = sharding.kv_sharding(mesh), sharding.replicated(mesh)
    return DecodeState(*(rep for _ in state))._replace(
        k=tuple(kv for _ in state.k), v=tuple(kv for _ in state.v))


class DecoderEngine:
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
        compile_ahead: str = "all",
        attention: str = "auto",
    ) -> None:
        """kv_blocks: pool size (0: enough for every slot to hold a full context, the
        memory of the old fixed rows); prefill_chunk: longest prefill piece (0: the
        largest bucket). quant_form: auto (the fastest allowed per bucket, chosen at
        `warmup`) or one of engine/forms.py's forms; weight_budget: bytes all held
        forms' weights may take (0: the float32 size of the weights); forms_cache:
        the choice's file ("": beside the compilation cache; None: not kept).
        compile_ahead: what `warmup` compiles before it returns: "all" shapes, or the
        "first" a request needs (the rest on a background thread). attention: the
        decode step's paged attention (engine/decoder/attention.py: auto, xla,
        pallas)."""
        from engine import forms, sharding
        from engine.jaxrt import device_name, dtype_name, parse_dtype
        from engine.quant import check_mode

        t0 = time.perf_counter()
        if compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"compile_ahead {compile_ahead!r}: use one of {', '.join(COMPILE_AHEAD)}")
        self.compile_ahead = compile_ahead
        self.name = name
        self.model_dir = Path(model_dir)
        self.quant = check_mode(quant)
        self.quant_form = forms.check_form(quant_form, self.quant)
        tp = sharding.parse(tensor_parallel)
        cfg = load_config(model_dir)
        if tp > 1:
            sharding.check_divisible(name, tp, query_heads=cfg.heads, kv_heads=cfg.kv_heads,
                                     mlp_columns=cfg.intermediate)  # fmt: skip
        self._mesh = sharding.make_mesh(tp)
        self.devices = sharding.engine_devices(self._mesh)  # e.g. ["cpu:0", "cpu:1"]
        self.cfg: DecoderConfig = dataclasses.replace(cfg, tensor_parallel=tp)
        limit = min(self.cfg.max_positions, self.cfg.sliding_window or self.cfg.max_positions)
        if max_context > limit:
            log.warning("max_context_capped", requested=max_context, limit=limit)
        self._max_context = min(int(max_context), limit)
        if self._max_context < 2:
            raise ValueError("max_context must be at least 2")
        self._slots = int(slots)
        self._dtype = dtype_name(dtype)
        self._jdtype = parse_dtype(dtype)
        self.block = int(kv_block)
        self.windows = _windows(decode_windows, self._max_context, self.block)
        self.batches = _batches(self._slots)
        self._max_blocks = self.windows[-1] // self.block  # table width: a full context
        chunk = int(prefill_chunk) or max(prefill_buckets)
        self.chunk = min(chunk, self.windows[-1])
        self.buckets = _buckets(tuple(prefill_buckets), self.chunk)
        # Contexts a prefill chunk may attend to: every other decode window and the
        # largest (fewer compiles; a chunk reads at most one step up).
        ctx = [w for i, w in enumerate(reversed(self.windows)) if i % 2 == 0]
        self.contexts = tuple(sorted(ctx))
        self.device = device_name()
        self.attention = attention_kernel.pick(attention, jax.devices()[0].platform)
        self.tokenizer = self._load_tokenizer()
        self._load_forms(weight_budget, forms_cache)
        blocks = int(kv_blocks) or self._slots * self._max_blocks + 1
        self.pool = BlockPool(blocks, self.block, prefix_cache)
        self._state = init_decode_state(self.cfg, self._slots, blocks, self.block, self._jdtype)
        self._warm_sampling = _slot_sampling(GREEDY, self.cfg.vocab_size, [])  # warm-up, lowering
        # Sharded: the state keeps its layout across calls (the KV pool split by KV
        # head, the rest replicated), so each step's output is the next step's input
        # as is.
        out = {}
        if self._mesh is not None:
            state_sharding = _state_sharding(self._state, self._mesh)
            self._state = jax.device_put(self._state, state_sharding)
            out = {"out_shardings": (state_sharding, sharding.replicated(self._mesh))}
        cfg = self.cfg
        # state is the argument after params in both: donated, so updated in place.
        self._prefill = jax.jit(
            lambda params, state, *args: steps.prefill_chunk(params, cfg, state, *args),
            donate_argnums=1, **out,
        )  # fmt: skip
        # The Pallas kernel is written for GPUs; elsewhere it runs interpreted (tests).
        kernel, interpret = self.attention, jax.devices()[0].platform == "cpu"
        self._generate = jax.jit(
            lambda params, state, *args: steps.generate(params, cfg, state, *args, kernel,
                                                        interpret),
            donate_argnums=1, **out,
        )  # fmt: skip
        self._state_spec = _spec(self._state)
        self.programs = Programs(name)
        self.step_counts: dict[int, int] = {}  # batch bucket -> decode steps run at it
        self.weight_bytes = sum(param_bytes(t) for t in self._forms.values())
        # One table per slot, plus the dummy row's (all scratch) for padding rows.
        self._tables = np.full((self._slots + 1, self._max_blocks), SCRATCH, np.int32)
        self._held: list[list[int]] = [[] for _ in range(self._slots)]  # slot -> blocks
        self._jobs: dict[int, _Prefill] = {}  # slots between begin and their last chunk
        self._order = np.zeros(self._slots, np.int64)  # when each slot began (preemption)
        self._began = 0
        # Each sequence's tokens (prompt, then generated as the caller reads them), to
        # key its full blocks when it ends.
        self._tokens: list[list[int]] = [[] for _ in range(self._slots)]
        self._lengths = np.zeros(self._slots, np.int64)  # tokens in context per slot
        self._active = np.zeros(self._slots, bool)  # live: part of decode steps
        self._top = np.full(self._slots, -1, np.int64)  # top logprobs wanted (-1: none)
        # Each slot's last token's logprobs ([1 + 2K] int32 as steps.pack packs them),
        # kept only for sequences that asked for them.
        self._logprobs: list[np.ndarray | None] = [None] * self._slots
        log.info(
            "decoder_loaded", model=name, family=self.cfg.family, dtype=self._dtype,
            quant=self.quant, forms=list(self._forms), devices=self.devices,
            slots=self._slots, max_context=self._max_context, buckets=list(self.buckets),
            windows=list(self.windows), batches=list(self.batches), attention=self.attention, contexts=list(self.contexts), kv_block=self.block,
            kv_blocks=blocks, param_bytes=self.weight_bytes,
            cache_bytes=cache_bytes(self._state), seconds=round(time.perf_counter() - t0, 3),
        )  # fmt: skip

    def _load_forms(self, budget: int, cache) -> None:
        """Weights in every compute form this engine may run (engine/forms.py); until
        `select_forms` every bucket runs the forced form, or the stored one."""
        from engine import forms, quant, sharding
        from engine.decoder.model import load_param_forms

        want = ("float",) if self.quant == "none" else ("dequant",)
        if self.quant == "int8" and self.quant_form in ("auto", "w8a8"):
            want += ("w8a8",)
        trees = load_param_forms(self.model_dir, self.cfg, self._jdtype, self.quant, want,
                                 self._mesh)  # fmt: skip
        sizes = {f: param_bytes(t) for f, t in trees.items()}
        if self.quant != "none":
            sizes["float"] = quant.float_bytes(trees["dequant"], self._jdtype)
            budget = int(budget) or quant.float_bytes(trees["dequant"], np.float32)
            self.form_candidates = forms.candidates(self.quant, self.quant_form, sizes, budget)
            if "float" in self.form_candidates:
                f = quant.dequantize_tree(trees["dequant"], self._jdtype)
                trees["float"] = f if self._mesh is None else sharding.place(f, self._mesh)
        else:
            self.form_candidates = ("float",)
        self._forms = {f: t for f, t in trees.items() if f in self.form_candidates}
        self._forms_cache = forms.cache_path(cache)
        first = self.form_candidates[0] if len(self.form_candidates) == 1 else "dequant"
        self.compute_forms: dict[str, str] = {b: first for b in self.form_buckets}
        self.form_ms: dict[str, dict[str, float]] = {}  # bucket -> form -> ms measured
        self.forms_measured = False  # whether the last `select_forms` measured
        self.params = self._forms[first]  # the decode step's weights (benchmarks, tests)

    @property
    def form_buckets(self) -> list[str]:
        """Buckets a compute form is chosen for: each decode batch bucket (at any
        window) and each prefill length."""
        return [f"step {b}" for b in self.batches] + [f"prefill {b}" for b in self.buckets]

    def _params_for(self, bucket: str) -> dict:
        return self._forms[self.compute_forms[bucket]]

    def select_forms(self) -> dict[str, str]:
        """The fastest allowed compute form per bucket: measured once (each bucket's
        program at its smallest context), then read from the choice file. Forms no
        bucket chose are dropped (their memory goes back)."""
        from engine import forms

        if len(self._forms) > 1:
            saved = self.compute_forms

            def run(bucket: str, form: str):
                kind, size = bucket.split()
                self.compute_forms = dict(saved, **{bucket: form})
                if kind == "step":
                    return self._run_step(int(size), self.windows[0])[0]
                ctx = self.context_for(int(size))
                return self._run_chunk(self._slots, [0] * int(size), 0, int(size), ctx,
                                       self._warm_sampling, np.uint32(0))  # fmt: skip

            cfg = self.cfg
            fields = dict(model=self.name, family=cfg.family, layers=cfg.layers,
                          hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                          intermediate=cfg.intermediate, vocab=cfg.vocab_size,
                          dtype=self._dtype, quant=self.quant, tp=cfg.tensor_parallel,
                          windows=list(self.windows), contexts=list(self.contexts),
                          batches=list(self.batches))  # fmt: skip
            self.compute_forms = saved
            choices, ms, measured = forms.select(self.form_buckets, tuple(self._forms), run,
                                                 fields, self._forms_cache)  # fmt: skip
            self.compute_forms, self.form_ms, self.forms_measured = choices, ms, measured
            self._forms = {f: t for f, t in self._forms.items() if f in set(choices.values())}
            self.params = self._params_for(f"step {self.batches[-1]}")
            self.weight_bytes = sum(param_bytes(t) for t in self._forms.values())
        log.info("compute_forms", model=self.name, quant=self.quant, choices=self.compute_forms,
                 ms=self.form_ms, measured=self.forms_measured, weight_bytes=self.weight_bytes,
                 cache=str(self._forms_cache or ""))  # fmt: skip
        return dict(self.compute_forms)

    def _load_tokenizer(self):
        from engine.tokenizer import Tokenizer, has_tokenizer

        if not has_tokenizer(self.model_dir):
            return None

        return Tokenizer.from_dir(self.model_dir)

    # ------------------------------------------------------------- properties
    @property
    def slots(self) -> int:
        return self._slots

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.cfg.eos_token_ids

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by sequences (cached-only ones are free)."""
        return self.pool.held / self.pool.usable

    @property
    def active_slots(self) -> int:
        return int(self._active.sum())

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.cfg, self.block, self._jdtype)

    def cache_stats(self) -> CacheStats:
        p = self.pool
        return CacheStats(p.usable, p.held, p.cached, p.stats.queries, p.stats.hits,
                          p.stats.preemptions)

    @property
    def prefix_block(self) -> int:
        """Tokens per prefix key; 0 with the prefix cache off (nothing to route by)."""
        return self.block if self.pool.prefix_cache else 0

    def held_prefixes(self, limit: int) -> list[int]:
        """Short keys (shared.prefix) of the prompt prefixes cached here, at most `limit`."""
        return self.pool.summary(limit)

    def context_left(self, slot: int) -> int:
        """Tokens `slot` can still generate before its context is full."""
        return int(self._max_context - self._lengths[slot])

    # ----------------------------------------------------------------- warmup
    @property
    def compiles(self) -> list[tuple[str, int, int]]:
        """Every shape served: (prefill, bucket, context) and (step, batch, window),
        cheapest first within each kind."""
        pre = [("prefill", b, c) for c in self.contexts for b in self.buckets if c >= b]
        step = sorted((("step", b, w) for b in self.batches for w in self.windows),
                      key=lambda k: (k[1] * k[2], k[1]))  # fmt: skip
        return pre + step

    def first_compiles(self) -> list[tuple[str, int, int]]:
        """What a first request needs: one stream's step at the smallest window, and
        each prefill bucket at the smallest context (a longer prompt is chunked)."""
        c0 = self.contexts[0]
        return [("step", 1, self.windows[0])] + [
            ("prefill", b, c0) for b in self.buckets if b <= c0]

    def warmup(self, progress: bool = True, background: bool | None = None) -> int:
        """Compile what a first request needs (every shape unless `background`, which
        compiles the rest on a thread of its own, engine/decoder/programs.py) and run
        it once; return how many programs were compiled here. `background` defaults
        to the engine's `compile_ahead` ("first": True)."""
        from tqdm import tqdm

        if background is None:
            background = self.compile_ahead == "first"
        if self.quant != "none":
            self.select_forms()
        jobs = self.first_compiles() if background else self.compiles
        bar = tqdm(jobs, desc=f"compile {self.name}", file=sys.stderr, disable=not progress)
        t0 = time.perf_counter()
        for kind, size, other in bar:
            bar.set_postfix_str(f"{kind} {size} {other}")
            if kind == "prefill":
                # The dummy row: its table is all scratch, its state row nobody's.
                jax.block_until_ready(self._run_chunk(self._slots, [0] * size, 0, size, other,
                                                      self._warm_sampling, np.uint32(0)))
            else:
                jax.block_until_ready(self._run_step(size, other)[0])
        if background:
            # The thread holds the engine weakly: a dropped version stops compiling.
            ref = weakref.ref(self)
            rest = [k for k in self.compiles if k not in set(jobs)]
            self.programs.start_background(
                [(self._key(*k), functools.partial(_lower_weakly, ref, k)) for k in rest])
        log.info("decoder_warm", model=self.name, compiled=len(jobs), background=background,
                 total=len(self.compiles), seconds=round(time.perf_counter() - t0, 3))
        return len(jobs)

    def compile_progress(self) -> tuple[int, int]:
        """(programs compiled, programs this engine serves)."""
        return self.programs.compiled, max(self.programs.total, len(self.compiles))

    def close(self) -> None:
        """Stop compiling in the background (the engine is being dropped)."""
        self.programs.stop()

    # ------------------------------------------------------------- programs
    def _key(self, kind: str, size: int, other: int):
        form = self.compute_forms[f"{kind} {size}"]
        return (kind, size, other, form)

    def _lowering(self, kind: str, size: int, other: int):
        """A function that lowers the program of one shape (not called here)."""
        params = self._params_for(f"{kind} {size}")
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        if kind == "step":
            nw = other // self.block
            args = (i32(size), i32(size, nw), jax.ShapeDtypeStruct((size,), np.bool_))
            return lambda: self._generate.lower(params, self._state_spec, *args)
        u32 = jax.ShapeDtypeStruct((), np.uint32)
        args = (i32(size), i32(), i32(), i32(other // self.block), i32(),
                jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                             self._warm_sampling), u32)  # fmt: skip
        return lambda: self._prefill.lower(params, self._state_spec, *args)

    def _program(self, kind: str, size: int, other: int):
        return self.programs.get(self._key(kind, size, other), self._lowering(kind, size, other))

    def _choose(self, kind: str, size: int, other: int) -> tuple[int, int]:
        """The compiled shape that holds (size, other) at the least cost, or the exact
        one (compiled where it is first needed) when none is."""
        best = (size, other)
        cost = None
        for key in self.programs.keys():
            k, s, o, form = key
            if (k == kind and s >= size and o >= other and form == self.compute_forms[f"{k} {s}"]
                    and (cost is None or s * o < cost)):
                best, cost = (s, o), s * o
        return best

    # -------------------------------------------------------------- requests
    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def context_for(self, tokens: int) -> int:
        return next(c for c in self.contexts if c >= tokens)

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(prompt) > self._max_context - 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {self.name} accepts at most "
                f"{self._max_context - 1} (context {self._max_context}, one token "
                f"left to generate)"
            )
        need = self.pool.blocks_for(len(prompt) + 1)
        if need > self.pool.usable:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {self.name}'s KV cache holds at most "
                f"{self.pool.usable * self.block - 1} for one sequence"
            )

    def _reuse_keys(self, prompt: list[int]) -> list[bytes]:
        """Prefix keys of the blocks a prompt may reuse: full blocks, leaving at least
        one token to compute (its logits draw the first token)."""
        return prefix_keys(prompt[: (len(prompt) - 1) // self.block * self.block], self.block)

    def can_admit(self, prompt: list[int]) -> bool:
        """Whether `begin` would get its blocks now, leaving one block of headroom per
        sequence already running (each may cross into a new block next step)."""
        need = self.pool.need(self._reuse_keys(prompt), self.pool.blocks_for(len(prompt) + 1))
        return need + int(self._active.sum()) + len(self._jobs) <= self.pool.available

    def begin(self, slot: int, prompt: list[int], sampling: Sampling, seed: int) -> None:
        """Give `slot` its blocks (reusing a cached prefix); `prefill_step` computes it."""
        if not 0 <= slot < self._slots:
            raise ValueError(f"slot {slot} out of range [0, {self._slots})")
        self.check_prompt(prompt)
        if self._held[slot]:
            raise ValueError(f"slot {slot} is in use")
        keys = self._reuse_keys(prompt)
        total = self.pool.blocks_for(len(prompt) + 1)
        if self.pool.need(keys, total) > self.pool.available:
            raise RuntimeError(f"the KV pool has no room for {len(prompt)} tokens now")
        blocks, reused = self.pool.acquire(keys, total)
        self.pool.stats.queries += len(prompt)
        self.pool.stats.hits += reused * self.block
        self._held[slot] = blocks
        self._tables[slot, :] = SCRATCH
        self._tables[slot, : len(blocks)] = blocks
        self._began += 1
        self._order[slot] = self._began
        self._tokens[slot] = list(prompt)
        self._top[slot] = min(sampling.logprobs, MAX_LOGPROBS)
        self._logprobs[slot] = None
        self._jobs[slot] = _Prefill(list(prompt), reused * self.block,
                                    _slot_sampling(sampling, self.cfg.vocab_size, prompt),
                                    np.uint32(seed % 2**32), prefix_keys(prompt, self.block))

    def prefilling(self, slot: int) -> int:
        """Prompt tokens `slot` has still to compute (0: none, or not prefilling)."""
        job = self._jobs.get(slot)
        return len(job.prompt) - job.done if job is not None else 0

    def prefill_step(self, slot: int, budget: int = 0) -> int | None:
        """Compute the next chunk of `slot`'s prompt (at most `budget` tokens if > 0);
        return the first generated token after the last chunk, else None."""
        job = self._jobs[slot]
        n = min(len(job.prompt) - job.done, self.chunk, budget if budget > 0 else self.chunk)
        end = job.done + n
        bucket = self.bucket_for(n)
        bucket, ctx = self._choose("prefill", bucket, self.context_for(max(end, bucket)))
        packed = self._run_chunk(slot, job.prompt[job.done : end], job.done, bucket, ctx,
                                 job.sampling, job.seed)
        job.done = end
        full = end // self.block
        self.pool.register(self._held[slot][:full], job.keys[:full])
        if end < len(job.prompt):
            return None
        del self._jobs[slot]
        packed = np.asarray(packed)  # [2 + 2K]: the token, then its logprobs
        token = int(packed[0])
        self._active[slot] = True
        self._lengths[slot] = len(job.prompt) + 1
        self._tokens[slot].append(token)
        self._logprobs[slot] = packed[1:] if self._top[slot] >= 0 else None
        return token

    def prefill_insert(self, slot: int, prompt: list[int], sampling: Sampling, seed: int) -> int:
        """Start a sequence in `slot`, its whole prompt at once; return its first token."""
        self.begin(slot, prompt, sampling, seed)
        while (token := self.prefill_step(slot)) is None:
            pass
        return token

    def _run_chunk(self, slot: int, piece: list[int], offset: int, bucket: int, ctx: int,
                   sampling: SlotSampling, seed) -> jax.Array:
        """-> [2 + 2K] int32 on device: the drawn token, then its logprobs."""
        padded = np.zeros(bucket, np.int32)  # padded: [T]
        padded[: len(piece)] = piece
        table = np.array(self._tables[slot, : ctx // self.block])  # [NC]
        run = self._program("prefill", bucket, ctx)
        self._state, packed = run(
            self._params_for(f"prefill {bucket}"), self._state, padded, np.int32(offset),
            np.int32(len(piece)), table, np.int32(slot), sampling, seed,
        )  # fmt: skip
        return packed

    # ------------------------------------------------------------------ decode
    def make_room(self) -> list[int]:
        """Give every live slot the block its next step writes into. When the pool is
        dry, preempt the sequence that began last (live or prefilling), as often as
        needed; return the preempted slots (already freed: the caller re-runs them)."""
        preempted: list[int] = []
        for slot in np.flatnonzero(self._active)[np.argsort(self._order[self._active])]:
            if not self._active[slot]:
                continue  # preempted below for an older one
            while self.pool.blocks_for(int(self._lengths[slot])) > len(self._held[slot]):
                if self.pool.available:
                    b = self.pool.take()
                    self._tables[slot, len(self._held[slot])] = b
                    self._held[slot].append(b)
                    continue
                victim = max((s for s in range(self._slots) if self._held[s]),
                             key=lambda s: self._order[s])
                self.free(victim)
                self.pool.stats.preemptions += 1
                preempted.append(int(victim))
                if victim == slot:
                    break
        return preempted

    def _run_step(self, batch: int, window: int) -> tuple[jax.Array, np.ndarray]:
        """One decode step of the live slots at (batch bucket, window) -> (packed
        [B, 2 + 2K] on device: each row's token and logprobs, rows [B]: the slot of
        each row, the dummy row for padding)."""
        live = np.flatnonzero(self._active)
        rows = np.full(batch, self._slots, np.int32)  # [B]
        rows[: len(live)] = live
        tables = self._tables[rows, : window // self.block]  # [B, NW] (a copy)
        run = self._program("step", batch, window)
        self._state, tokens = run(self._params_for(f"step {batch}"), self._state, rows, tables,
                                  rows < self._slots)  # fmt: skip
        if len(live):  # warm-up and measuring runs are not steps
            self.step_counts[batch] = self.step_counts.get(batch, 0) + 1
        return tokens, rows

    def batch_for(self, live: int) -> int:
        return next(b for b in self.batches if b >= live)

    def window_for(self) -> int:
        """Smallest attention window that holds every active slot's next position."""
        need = int(self._lengths[self._active].max()) if self._active.any() else 1
        return next(w for w in self.windows if w >= need)

    def step(self) -> np.ndarray:
        """One decode step for every slot -> [slots] int32 (free slots: ignore)."""
        return self.step_async().result()

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
        live = np.flatnonzero(self._active)
        began = self._order[live].copy()  # which sequence each live slot held
        batch, window = self._choose("step", self.batch_for(len(live)), self.window_for())
        tokens, rows = self._run_step(batch, window)
        pending = PendingStep(tokens, rows, self._slots, preempted,
                              lambda host, lp: self._note(live, began, host, lp))
        self._lengths[self._active] = np.minimum(
            self._lengths[self._active] + 1, self._max_context
        )
        return pending

    def _note(self, live: np.ndarray, began: np.ndarray, host: np.ndarray,
              logprobs: np.ndarray) -> None:
        """A step's tokens reached the host: each goes on its sequence's record, unless
        that sequence has ended (or another began in its slot) since the dispatch;
        its logprobs, when it asked for them, wait for `token_logprobs`."""
        for slot, order in zip(live.tolist(), began.tolist()):
            if self._held[slot] and self._order[slot] == order:
                self._tokens[slot].append(int(host[slot]))
                if self._top[slot] >= 0:
                    self._logprobs[slot] = logprobs[slot]

    def token_logprobs(self, slot: int) -> tuple[float, list[tuple[int, float]]] | None:
        """The logprob of the token `slot` got last (from its last prefill chunk or
        the last step read) and its request's top logprobs, as (logprob, [(token id,
        logprob)]), best first; None when its request asked for none."""
        row = self._logprobs[slot]
        if row is None or self._top[slot] < 0:
            return None
        k = MAX_LOGPROBS
        lp = row[: 1 + 2 * k].view(np.float32)  # float32 bits
        ids, top = row[1 : 1 + k], lp[1 + k : 1 + 2 * k]
        n = int(self._top[slot])
        return float(lp[0]), [(int(i), float(v)) for i, v in zip(ids[:n], top[:n])]

    def _keep(self, slot: int) -> None:
        """Key the full blocks of the sequence in `slot` before it lets them go: its
        prompt's are keyed already (as computed); this adds those its decode steps
        filled. Only positions whose K/V has been written and whose token the host
        has seen count: `lengths - 1` (the last drawn token is never fed back)."""
        if not self.pool.prefix_cache or slot in self._jobs or not self._held[slot]:
            return
        tokens = self._tokens[slot]
        full = min(int(self._lengths[slot]) - 1, len(tokens)) // self.block
        if full > 0:
            self.pool.register(self._held[slot][:full],
                               prefix_keys(tokens[: full * self.block], self.block))

    def free(self, slot: int) -> None:
        """End the sequence in `slot` (idempotent): its blocks go back to the pool, its
        full ones keyed, so a prompt that continues it reuses them."""
        self._keep(slot)
        self.pool.release(self._held[slot])
        self._tokens[slot] = []
        self._held[slot] = []
        self._tables[slot, :] = SCRATCH
        self._jobs.pop(slot, None)
        self._active[slot] = False
        self._lengths[slot] = 0

    # -------------------------------------------------------------- benchmark
    def generate_static(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy, `max_new` tokens for each prompt, `slots` prompts at a time, all
        decoding in lock-step (a static batch: the engine's ceiling)."""
        out: list[list[int]] = []
        for start in range(0, len(prompts), self._slots):
            group = prompts[start : start + self._slots]
            for p in group:
                if len(p) + max_new > self._max_context:
                    raise ValueError(f"{len(p)} + {max_new} tokens exceed the context")
            seqs = [[self.prefill_insert(i, p, GREEDY, 0)] for i, p in enumerate(group)]
            for _ in range(max_new - 1):
                tokens = self.step()
                for i, seq in enumerate(seqs):
                    seq.append(int(tokens[i]))
            for i in range(len(group)):
                self.free(i)
            out.extend(seqs)
        return out


def _lower_weakly(ref: "weakref.ref[DecoderEngine]", shape: tuple[str, int, int]):
    engine = ref()
    if engine is None:
        raise LookupError("the engine was dropped")
    return engine._lowering(*shape)()


def _slot_sampling(sampling: Sampling, vocab: int, prompt: list[int]) -> SlotSampling:
    """A request's sampling parameters as the prefill takes them; `seen` marks the
    prompt's tokens only when a repetition penalty will read them."""
    bias = [(t, b) for t, b in sampling.logit_bias if 0 <= t < vocab][:MAX_BIAS]
    ids, vals = np.zeros(MAX_BIAS, np.int32), np.zeros(MAX_BIAS, np.float32)
    if bias:
        ids[: len(bias)], vals[: len(bias)] = zip(*bias)
    seen = np.zeros(vocab, np.bool_)
    if sampling.repetition_penalty != 1.0:
        seen[np.asarray(prompt, np.int64)] = True
    return SlotSampling(
        temperature=np.float32(max(0.0, sampling.temperature)),
        top_k=np.int32(sampling.top_k if sampling.top_k > 0 else 0),
        top_p=np.float32(sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0),
        min_p=np.float32(min(max(sampling.min_p, 0.0), 1.0)),
        presence=np.float32(sampling.presence_penalty),
        frequency=np.float32(sampling.frequency_penalty),
        repetition=np.float32(sampling.repetition_penalty if sampling.repetition_penalty > 0
                              else 1.0),
        bias_ids=ids, bias_vals=vals, seen=seen,
        logprobs=np.int32(min(sampling.logprobs, MAX_LOGPROBS)),
    )
