"""The compute form each bucket of a quantized decoder runs (engine/forms.py),
chosen by measurement without delaying the first token.

  1. Built, it loads the weights of every candidate form.
  2. The engine's `warmup` calls `start`. With the choice stored for this engine's key
     (the forms file beside the compilation cache) every bucket runs its stored form
     from the start and nothing is measured. With a cold file every bucket runs a
     fallback: the newest choice stored for this model under another key (other
     shapes, another device), else the first candidate (float where the weight
     budget holds it, else dequant); the measuring programs (every form at each
     bucket's measuring shape) join the background compiles, and the engine is
     ready with the fallback's first programs only.
  3. The caller (the worker's decoder runner, between steps) asks `due` and
     calls `measure` (through the engine's `tune`): one (bucket, form) at a time, on the engine thread, on
     the dummy row (no sequence's state or cache is touched), only once that
     program is compiled (any time when nothing compiles in the background). When
     a bucket's forms are all measured the fastest is its choice; once every
     bucket has one, the choice is stored for the next start.
  4. A bucket whose choice is not the form it runs switches between two steps,
     once the chosen form has every program of that bucket the old one had
     compiled (queued at the front of the background compiles at the choice; at
     once with `compile_ahead="lazy"`, or from `select_forms`). Programs and
     weights of forms nothing runs any more are dropped.

Float and dequant compute the same function (greedy tokens equal); w8a8 adds the
activations' rounding, so a bucket switching to it computes as a start with a warm
file would have from the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import forms, sharding
from engine import quant as q
from engine.decoder.config import DecoderConfig
from engine.decoder.model import load_param_forms
from engine.prepared import directory as prepared_directory
from shared.logging import get_logger

if TYPE_CHECKING:
    from engine.decoder.compiled import StepPrograms

log = get_logger(__name__)
FORM_REPEATS = 3  # timed runs of a (bucket, form), after one untimed run


def form_bucket(kind: str, size: int) -> str:
    """The bucket whose compute form a program runs: a verify pass is one stream's
    step (engine/decoder/speculative.py), a mixed step the prefill chunk of its size
    (most of its tokens are a prompt's)."""
    if kind == "verify":
        return "step 1"
    return f"prefill {size}" if kind == "mixed" else f"{kind} {size}"


class FormChoice:
    """The per-bucket compute forms of one decoder (see the module docstring). It
    runs nothing itself: the methods that compile or time take the engine's
    programs and a function that runs one bucket's measuring shape in a form."""

    def __init__(self, name: str, model_dir: str | Path, cfg: DecoderConfig, dtype: str,
                 jdtype, quant: str, quant_form: str, mesh, budget: int, cache,
                 weights_cache, buckets: list[str], key_shapes: dict,
                 compile_ahead: str) -> None:
        """Weights in every compute form this engine may run (engine/forms.py); until
        `start` every bucket runs the forced form, or the stored one. buckets: the
        buckets a form is chosen for ("step 16", "prefill 64"); key_shapes: the
        shapes that key a stored choice (windows, contexts, batches)."""
        self.name = name
        self.cfg = cfg
        self.quant = quant
        self.compile_ahead = compile_ahead
        self.buckets = buckets
        self._dtype = dtype
        self._key_shapes = key_shapes
        want: tuple[str, ...] = ("float",) if quant == "none" else ("dequant",)
        if quant == "int8" and quant_form in ("auto", "w8a8"):
            want += ("w8a8",)
        trees = load_param_forms(model_dir, cfg, jdtype, quant, want, mesh,
                                 prepared_directory(weights_cache))  # fmt: skip
        if quant != "none":
            self.candidates = add_forms(trees, quant, quant_form, budget, jdtype, mesh)
        else:
            self.candidates = ("float",)
        self.held = {f: t for f, t in trees.items() if f in self.candidates}  # form -> weights
        self._cache = forms.cache_path(cache)
        first = self.candidates[0] if len(self.candidates) == 1 else "dequant"
        self.compute_forms: dict[str, str] = {b: first for b in buckets}
        self.form_ms: dict[str, dict[str, float]] = {}  # bucket -> form -> ms measured
        self.measured = False  # whether this engine measured (and stored) its choice
        self.measurements = 0  # (bucket, form) pairs measured so far
        self.units = 0  # (bucket, form) pairs it measures in all (0: none)
        self._todo: list[tuple[str, str]] = []  # (bucket, form) still to measure
        self._winners: dict[str, str] = {}  # bucket -> its measured (or stored) form
        self._key: tuple[dict, str] | None = None
        self._started = False  # `start` ran
        self._final = len(self.held) == 1  # each bucket runs its choice, the rest dropped
        self.weight_bytes = forms.held_bytes(self.held)

    def form_of(self, kind: str, size: int) -> str:
        return self.compute_forms[form_bucket(kind, size)]

    def params_of(self, form: str) -> dict:
        if form not in self.held:  # dropped while a compile of it waited
            raise ValueError(f"compute form {form!r} is no longer held")
        return self.held[form]

    def params_for(self, kind: str, size: int) -> dict:
        """The weights the program of (kind, size) runs with."""
        return self.held[self.form_of(kind, size)]

    @property
    def params(self) -> dict:
        """The largest decode step's weights (benchmarks, tests, prompt scoring)."""
        steps = [b for b in self.buckets if b.startswith("step ")]
        return self.held[self.compute_forms[steps[-1]]]

    def _key_fields(self) -> tuple[dict, str]:
        if self._key is None:
            cfg = self.cfg
            fields = dict(model=self.name, family=cfg.family, layers=cfg.layers,
                          hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                          intermediate=cfg.intermediate, vocab=cfg.vocab_size,
                          dtype=self._dtype, quant=self.quant, tp=cfg.tensor_parallel,
                          **self._key_shapes)  # fmt: skip
            self._key = fields, forms.key_of(fields, self.buckets, tuple(self.held))
        return self._key

    # ------------------------------------------------------------------ start
    def start(self, programs: StepPrograms) -> list[tuple[tuple[str, int, int], str]]:
        """Each bucket's form at warm-up: the stored choice, else a fallback while
        the measuring waits for after ready -> the measuring programs, (shape, form),
        for the background compiles (none when nothing is measured)."""
        if self._started:
            return []
        self._started = True
        if len(self.held) == 1:
            self._final = True
            self._log()
            return []
        fields, key = self._key_fields()
        entry = forms.lookup(key, self.buckets, self._cache)
        if entry is not None:  # warm: nothing compiled yet, so every bucket switches now
            self.form_ms, self._winners = entry.get("ms", {}), dict(entry["choices"])
            self._settle(programs, at_once=True)
            return []
        last = forms.last_choice(self.name, self._cache)
        first = self.candidates[0]
        self.compute_forms = {b: last[b] if last.get(b) in self.held else first
                              for b in self.buckets}  # fmt: skip
        self._todo = [(b, f) for b in self.buckets for f in self.held]
        self.units = len(self._todo)
        log.info("compute_forms_fallback", model=self.name, quant=self.quant,
                 forms=self.compute_forms, measuring=self.units,
                 cache=str(self._cache or ""))  # fmt: skip
        return [(measure_shape(programs, b), f) for b, f in self._todo]

    @property
    def settled(self) -> bool:
        """Every bucket runs its choice (nothing left to measure or to switch; set
        last, so another thread may read it)."""
        return self._final

    # -------------------------------------------------------------- measuring
    def select(self, programs: StepPrograms, run: Callable[[str, str], object]) -> dict[str, str]:
        """Every bucket's form now, measuring what the file does not hold, compiling
        where needed (benchmarks, tests); the worker measures after ready instead.
        run(bucket, form): one run of the bucket's measuring shape in that form."""
        self.start(programs)
        while self._todo:
            self._measure_unit(programs, run, *self._todo[0])
        self._settle(programs, at_once=True)
        return dict(self.compute_forms)

    def due(self, programs: StepPrograms) -> bool:
        """Whether `measure` has work it can do now without compiling here."""
        if self._final:  # settled: nothing left (the usual answer, on every stats call)
            return False
        return (self._next_unit(programs) is not None
                or any(self._switchable(programs, b) for b in self._pending()))

    def measure(self, programs: StepPrograms, run: Callable[[str, str], object],
                limit: int = 1) -> int:
        """Measure up to `limit` (bucket, form) pairs whose programs are compiled,
        then switch the buckets that may switch -> pairs measured. On the engine
        thread, between steps."""
        done = 0
        while done < limit and (unit := self._next_unit(programs)) is not None:
            self._measure_unit(programs, run, *unit, tolerant=True)
            done += 1
        self._settle(programs, at_once=self.compile_ahead == "lazy")
        return done

    def _next_unit(self, programs: StepPrograms) -> tuple[str, str] | None:
        inline = not programs.cache.compiling  # nothing will compile it for us
        for bucket, form in self._todo:
            if inline or programs.has((*measure_shape(programs, bucket), form)):
                return bucket, form
        return None

    def _measure_unit(self, programs: StepPrograms, run, bucket: str, form: str,
                      tolerant: bool = False) -> None:
        """Time one (bucket, form); `tolerant`: a form that fails here is recorded as
        never fastest (it would fail where it runs too) instead of raising."""
        try:
            ms = round(forms.timed(lambda: run(bucket, form), FORM_REPEATS), 3)
        except Exception as exc:
            if not tolerant:
                raise
            log.warning("form_measure_failed", model=self.name, bucket=bucket, form=form,
                        error=repr(exc))  # fmt: skip
            ms = float("inf")
        self._todo.remove((bucket, form))
        self._record(programs, bucket, form, ms)

    def _record(self, programs: StepPrograms, bucket: str, form: str, ms: float) -> None:
        self.measurements += 1
        self.form_ms.setdefault(bucket, {})[form] = ms
        if any(b == bucket for b, _ in self._todo):
            return
        self._winners[bucket] = winner = forms.fastest(self.form_ms[bucket])
        if winner != self.compute_forms[bucket] and self.compile_ahead != "lazy":
            shapes = programs.bucket_shapes(bucket)
            held = [k for k in shapes if programs.has((*k, self.compute_forms[bucket]))]
            order = held + [k for k in shapes if k not in held]
            programs.compile_background([(k, winner) for k in order], first=True)
        if not self._todo:
            fields, key = self._key_fields()
            try:
                forms.store(self._cache, key, fields, dict(self._winners), self.form_ms)
            except OSError as exc:  # served as chosen all the same; the next start measures
                log.warning("compute_forms_not_stored", model=self.name, error=repr(exc))
            self.measured = True

    # -------------------------------------------------------------- switching
    def _pending(self) -> list[str]:
        return [b for b, f in self._winners.items() if self.compute_forms[b] != f]

    def _switchable(self, programs: StepPrograms, bucket: str) -> bool:
        """Whether the chosen form has every program of `bucket` its form has now."""
        now, new = self.compute_forms[bucket], self._winners[bucket]
        return all(programs.has((*k, new)) for k in programs.bucket_shapes(bucket)
                   if programs.has((*k, now)))

    def _settle(self, programs: StepPrograms, at_once: bool = False) -> None:
        """Switch the buckets whose choice may run now; once every bucket runs its
        choice, drop the forms (weights, programs) nothing runs."""
        switched = [b for b in self._pending() if at_once or self._switchable(programs, b)]
        for bucket in switched:
            self.compute_forms[bucket] = self._winners[bucket]
        if switched:
            log.info("compute_form_switched", model=self.name,
                     forms={b: self.compute_forms[b] for b in switched})  # fmt: skip
        if self._todo or self._pending() or self._final:
            if switched:
                programs.cache.drop(self._keeps)
            return
        self._final = True
        used = set(self.compute_forms.values())
        self.held = {f: t for f, t in self.held.items() if f in used}
        self.weight_bytes = forms.held_bytes(self.held)
        programs.cache.drop(self._keeps)
        self._log()

    def _keeps(self, key) -> bool:
        """Whether a compiled program is still wanted: its bucket runs its form, will
        switch to it, or has it still to measure."""
        kind, size, _, form = key
        bucket = form_bucket(kind, size)
        return (form == self.compute_forms[bucket] or form == self._winners.get(bucket)
                or (bucket, form) in self._todo)  # fmt: skip

    def _log(self) -> None:
        log.info("compute_forms", model=self.name, quant=self.quant, choices=self.compute_forms,
                 ms=self.form_ms, measured=self.measured, weight_bytes=self.weight_bytes,
                 cache=str(self._cache or ""))  # fmt: skip


def add_forms(trees: dict, quant: str, setting: str, budget: int, dtype, mesh) -> tuple[str, ...]:
    """A quantized model's candidate forms; adds the "float" and "kernel" trees to
    `trees` (which holds "dequant", and "w8a8" where loaded) where they are candidates.
    budget: bytes all forms' weights may take (0: the float32 size)."""
    sizes = {f: q.tree_bytes(t) for f, t in trees.items()}
    sizes["float"] = q.float_bytes(trees["dequant"], dtype)
    sizes["kernel"] = sizes["kernel8"] = 0  # the stored arrays, shared
    budget = int(budget) or q.float_bytes(trees["dequant"], np.float32)
    kernel = forms.kernel_usable(quant, setting, dtype, mesh)
    found = forms.candidates(quant, setting, sizes, budget, kernel)
    if "float" in found:
        f = q.dequantize_tree(trees["dequant"], dtype)
        trees["float"] = f if mesh is None else sharding.place(f, mesh)
    packed = None
    for form in forms.KERNEL_FORMS:  # both over one packing of the stored arrays
        if form in found:
            packed = q.with_compute(packed or trees["dequant"], form)
            trees[form] = packed
    return found



def measure_shape(programs: StepPrograms, bucket: str) -> tuple[str, int, int]:
    """The shape a bucket is measured at: the step at its smallest window, a prefill
    chunk at its smallest context."""
    kind, size = bucket.split()
    other = programs.windows[0] if kind == "step" else programs.context_for(int(size))
    return kind, int(size), other
