"""The decoder's compiled programs: which shapes it serves, how each is lowered, and
which compiled one runs a given piece of work.

  1. The shapes are fixed when the engine is built: prefill chunks per (length
     bucket, context it may attend to), decode steps per (batch bucket, attention
     window), and, with speculation, verify passes per window (engine/decoder/shapes.py).
  2. A program is keyed (kind, size, other, form): its shape and the compute form
     its bucket runs (engine/decoder/formchoice.py). `get` returns it compiled
     (engine/programs.py: compiled once, where first asked for, or on the
     background thread ahead of that).
  3. On the CPU kernel, mixed programs (`mixed_shapes`: the prefill chunk's
     tokens through 16, 32 ... table rows, up to the slots) run decode rows and
     prompt chunks of several sequences in one pass (docs/decisions/0087). They
     are compiled in the background, first; until one that holds the live rows
     is, chunks and steps run apart.
  4. `choose` picks the cheapest compiled shape that holds the work (a larger
     bucket or window computes the same tokens); while the background still
     compiles, `step_shape` runs a step in parts of a smaller compiled batch and
     `prefill_shape` computes a shorter chunk on a compiled program rather than
     compile the exact one on the serving path. The first set (`first_compiles`)
     holds what makes that always possible: one stream's step at every window and a
     prefill program reaching every context.

Every per-request value (slot, offset, length, block table, seed, sampling, the
structured outputs' token mask) is an argument, traced; the state is donated, so the
KV pool is updated in place.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from engine.decoder import steps
from engine.decoder.formchoice import FormChoice, form_bucket
from engine.decoder.sampling import mask_words
from engine.programs import Programs
from engine.decoder.shapes import i32
from engine.decoder.verify import verify

Shape = tuple[str, int, int]  # (kind, size, other): ("step", batch, window), ...
Key = tuple[str, int, int, str]  # a program's: (kind, size, other, form)
# The jitted lambdas call the steps through it: mypy cannot count what *args fills.
_Step = Callable[..., Any]
# The first set's prefill program holds a prompt of this many tokens: a short chat
# turn (30-60 tokens with its template) runs on it, not on the largest chunk (1.3 s
# for 512 tokens on two cores) while the rest compile. On the CPU kernel it is the
# only one: a longer prompt in 64-token chunks costs what it does in 512-token ones
# (SmolLM2, distinct prompts: 500 tokens 1,298 vs 1,238 ms, 1,500 tokens 5.6 vs
# 5.5 s), and the largest program's compile and first run (4-5 s) leave the start.
FIRST_PROMPT = 64


class StepPrograms:
    def __init__(self, name: str, cfg, forms: FormChoice, state_spec, sampling_spec,
                 block: int, buckets: tuple[int, ...], contexts: tuple[int, ...],
                 batches: tuple[int, ...], windows: tuple[int, ...], spec_k: int,
                 attention: str, jit_kw: dict, mixed: bool = True) -> None:
        """state_spec, sampling_spec: the decode state's and a slot's sampling
        arguments' shapes (lowering never reads buffers a step may have donated);
        jit_kw: the output shardings of a sharded engine ({} otherwise)."""
        self.name = name
        self.cfg = cfg
        self.forms = forms
        self.block = block
        self.buckets, self.contexts = buckets, contexts
        self.batches, self.windows = batches, windows
        self.spec_k = spec_k
        self.width = mask_words(cfg.vocab_size)  # int32 words of a row's token mask
        self._allowed: dict[int, jax.Array] = {}  # rows -> all-set masks, kept on device
        # (tokens, table rows) of the mixed steps, fewest rows first; none off the CPU
        # kernel. The lm head runs on every row, so rows come in buckets: 64 rows for
        # 17 cost SmolLM2 a fifth more per step (0087).
        top = max(buckets)
        rows = sorted({b for b in batches if b >= min(16, batches[-1]) and b <= top}
                      | {min(batches[-1], top)})
        self.mixed_shapes = [(top, r) for r in rows] if mixed and attention == "cpu" else []
        self.compiles = self._served()  # fixed with the shapes: read on every stats call
        self.attention = attention
        self.jit_kw = jit_kw
        self.state_spec = state_spec
        self.sampling_spec = sampling_spec
        self.cache: Programs[Key] = Programs(name)
        self.step_counts: dict[int, int] = {}  # batch bucket -> decode steps run at it
        self.mixed_counts: dict[int, int] = {}  # table rows -> mixed steps run at them
        # The Pallas kernel is written for GPUs; elsewhere it runs interpreted (tests).
        interpret = jax.devices()[0].platform == "cpu"
        self.interpret = interpret
        # state is the argument after params in each: donated, so updated in place.
        self._prefill = jax.jit(lambda params, state, *args: cast(_Step, steps.prefill_chunk)(
            params, cfg, state, *args, kernel=attention), donate_argnums=1, **jit_kw)  # fmt: skip
        self._generate = jax.jit(lambda params, state, *args: cast(_Step, steps.generate)(
            params, cfg, state, *args, attention, interpret), donate_argnums=1, **jit_kw)  # fmt: skip
        self._verify = jax.jit(lambda params, state, *args: cast(_Step, verify)(
            params, cfg, state, *args, attention, interpret), donate_argnums=1, **jit_kw)  # fmt: skip
        self._mixed = jax.jit(lambda params, state, *args: cast(_Step, steps.mixed)(
            params, cfg, state, *args), donate_argnums=1, **jit_kw)  # fmt: skip
        self.claim = jax.jit(steps.claim, donate_argnums=0,
                             **({"out_shardings": jit_kw["out_shardings"][0]} if jit_kw else {}))
        self.copy = jax.jit(steps.copy_block, donate_argnums=0,
                            **({"out_shardings": jit_kw["out_shardings"][0]} if jit_kw else {}))

    # ---------------------------------------------------------------- shapes
    def _served(self) -> list[Shape]:
        """Every shape served: (prefill, bucket, context) and (step, batch, window),
        cheapest first within each kind, then verify passes."""
        pre = [("prefill", b, c) for c in self.contexts for b in self.buckets if c >= b]
        step = sorted((("step", b, w) for b in self.batches for w in self.windows),
                      key=lambda k: (k[1] * k[2], k[1]))  # fmt: skip
        mixed = [("mixed", *shape) for shape in self.mixed_shapes]
        return mixed + pre + step + self.verify_compiles()

    def verify_compiles(self) -> list[Shape]:
        return [("verify", self.spec_k + 1, w) for w in self.windows] if self.spec_k else []

    def first_compiles(self) -> list[Shape]:
        """What is compiled before ready: one stream's step at every window (any
        number of streams runs on it, in parts), the prefill bucket that holds a
        short prompt (FIRST_PROMPT) and, off the CPU kernel, the largest one at the
        smallest context, and that largest bucket at every other context (a prompt
        of any length is computed in chunks of it). The rest stand in for each other
        as they join (each costs ~1 s even cached)."""
        c0 = self.contexts[0]
        top = max(b for b in self.buckets if b <= c0)
        small = self.bucket_for(min(FIRST_PROMPT, top))
        ends = [small] if self.attention == "cpu" else sorted({small, top})
        return ([("step", 1, self.windows[0])] + [("prefill", b, c0) for b in ends]
                + [("step", 1, w) for w in self.windows[1:]]
                + [("prefill", top, c) for c in self.contexts[1:]]
                + self.verify_compiles()[:1])

    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def context_for(self, tokens: int) -> int:
        return next(c for c in self.contexts if c >= tokens)

    def batch_for(self, live: int) -> int:
        return next(b for b in self.batches if b >= live)

    def window_for(self, need: int) -> int:
        return next(w for w in self.windows if w >= need)

    def bucket_shapes(self, bucket: str) -> list[Shape]:
        """The shapes whose compute form is `bucket`'s ("step 16", "prefill 64")."""
        return [k for k in self.compiles if form_bucket(k[0], k[1]) == bucket]

    # -------------------------------------------------------------- programs
    def key(self, kind: str, size: int, other: int, form: str | None = None) -> Key:
        return (kind, size, other, form or self.forms.form_of(kind, size))

    def lowering(self, kind: str, size: int, other: int, form: str | None = None):
        """A function that lowers the program of one shape (not called here), in
        `form` (default: the one its bucket runs)."""
        form = form or self.forms.form_of(kind, size)
        params = self.forms.params_of(form)  # ValueError: dropped while it waited
        args: tuple[jax.ShapeDtypeStruct, ...]
        if kind == "verify":
            args = (i32(size), i32(), i32(), i32(other // self.block), i32())
            return lambda: self._verify.lower(params, self.state_spec, *args)
        if kind == "step":
            args = (i32(size), i32(size, other // self.block), jax.ShapeDtypeStruct((size,), bool),
                    i32(size, self.width))  # fmt: skip
            return lambda: self._generate.lower(params, self.state_spec, *args)
        if kind == "mixed":  # size tokens through `other` table rows, a full context wide
            wide = self.windows[-1] // self.block
            args = (i32(size), i32(size), i32(size), i32(size),
                    jax.ShapeDtypeStruct((size,), bool), i32(other, wide), i32(other),
                    i32(other), jax.ShapeDtypeStruct((other,), bool),
                    i32(other, self.width))  # fmt: skip
            return lambda: self._mixed.lower(params, self.state_spec, *args)
        u32 = jax.ShapeDtypeStruct((), np.uint32)
        args = (i32(size), i32(), i32(), i32(other // self.block), i32(), self.sampling_spec, u32,
                i32(self.width))  # fmt: skip
        return lambda: self._prefill.lower(params, self.state_spec, *args)

    def get(self, kind: str, size: int, other: int, form: str | None = None):
        """The executable of one shape, compiled now if nobody has."""
        return self.cache.get(self.key(kind, size, other, form),
                              self.lowering(kind, size, other, form))

    def allowed(self, rows: int = 0) -> jax.Array:
        """The all-set mask of `rows` rows ([rows, W]; 0: one row's [W]): what a row
        with no grammar passes. Made once per size and kept on the device."""
        mask = self._allowed.get(rows)
        if mask is None:
            mask = self._allowed[rows] = jnp.full((rows, self.width) if rows else (self.width,),
                                                  -1, jnp.int32)  # fmt: skip
        return mask

    def has(self, key) -> bool:
        return self.cache.has(key)

    def compile_background(self, shapes: list[tuple[Shape, str | None]],
                           first: bool = False) -> None:
        """Compile (shape, form) pairs on the background thread (form None: the one
        its bucket runs now); `first`: ahead of those waiting."""
        ref = weakref.ref(self)  # the thread holds the programs weakly: a dropped engine stops
        jobs: list[tuple[Key, Callable[[], object]]] = []
        for shape, form in shapes:
            form = form or self.forms.form_of(*shape[:2])
            jobs.append((self.key(*shape, form=form), functools.partial(_lower, ref, shape, form)))
        self.cache.start_background(jobs, first=first)

    def choose(self, kind: str, size: int, other: int) -> tuple[int, int]:
        """The compiled shape that holds (size, other) at the least cost, or the exact
        one (compiled where it is first needed) when none is."""
        best, cost = (size, other), None
        for k, s, o, form in self.cache.keys():
            if (k == kind and s >= size and o >= other and form == self.forms.form_of(k, s)
                    and (cost is None or s * o < cost)):
                best, cost = (s, o), s * o
        return best

    def mixed_shape(self, live: int, rows: int) -> tuple[int, int] | None:
        """(tokens, table rows) of a mixed step for `live` decode rows and `rows` in
        all: the fewest compiled rows that hold them all, else the most compiled
        (that hold the live ones and some chunks); None when none holds the live
        rows and one chunk (they run apart)."""
        compiled = [s for s in self.mixed_shapes if self.cache.has(self.key("mixed", *s))]
        fits = [s for s in compiled if s[1] >= rows]
        if fits:
            return fits[0]
        return compiled[-1] if compiled and compiled[-1][1] > live else None

    def prefill_shape(self, done: int, end: int) -> tuple[int, int, int]:
        """(bucket, context, where the chunk ends) for a prompt chunk [done, end): the
        cheapest compiled program that holds it; else, while the background
        compiles, the compiled one that computes the longest piece of it from
        `done`; else the exact shape, compiled now."""
        fits = self.bucket_for(end - done)
        bucket, ctx = self.choose("prefill", fits, self.context_for(max(end, fits)))
        if self.cache.has(self.key("prefill", bucket, ctx)) or not self.cache.compiling:
            return bucket, ctx, end
        best = None  # (tokens, -cost, bucket, context)
        for k, s, o, form in self.cache.keys():
            piece = min(end - done, s, o - done)
            if k == "prefill" and piece > 0 and form == self.forms.form_of(k, s):
                best = max(best or (0,), (piece, -s * o, s, o))
        if best is None:
            return bucket, ctx, end
        return best[2], best[3], done + best[0]

    def step_shape(self, live: int, need: int, coming: int = 0) -> tuple[int, int]:
        """(batch bucket, window) of the next step: the cheapest compiled shape that
        holds it; else, while the background compiles, the largest compiled bucket at
        a window that holds it, run in parts (and the one that holds the live rows
        and the `coming` ones, sequences in prefill, compiled next at normal priority:
        `Programs.want`; wanting each bucket as a burst of streams joins compiled 2,
        then 8, then 16, 11 s each under load); else the exact shape, compiled now."""
        batch, window = self.choose("step", self.batch_for(live), self.window_for(need))
        if self.cache.has(self.key("step", batch, window)) or not self.cache.compiling:
            return batch, window
        parts = [(s, o) for k, s, o, form in self.cache.keys()
                 if k == "step" and o >= window and s < batch
                 and form == self.forms.form_of("step", s)]  # fmt: skip
        if not parts:
            return batch, window
        ahead = max(batch, self.batch_for(min(live + coming, self.batches[-1])))
        if not self.cache.has(self.key("step", ahead, window)):
            self.cache.want(self.key("step", ahead, window))
        return max(parts, key=lambda p: (p[0], -p[1]))

    def progress(self) -> tuple[int, int]:
        """(programs compiled, programs served; the measuring programs of the compute
        forms too while they are measured)."""
        return self.cache.compiled, max(self.cache.total, len(self.compiles))


def _lower(ref, shape: Shape, form: str):
    """The lowered program of `shape` in compute form `form` of the programs `ref`
    (a weakref) names; LookupError when they were dropped (their engine was:
    its background compiles stop)."""
    programs = ref()
    if programs is None:
        raise LookupError("the engine was dropped")
    return programs.lowering(*shape, form=form)()
