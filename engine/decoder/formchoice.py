"""The compute form each bucket of a quantized decoder runs (engine/forms.py),
chosen by measurement without delaying the first token.

  1. `_load_forms` loads the weights of every candidate form.
  2. `warmup` calls `_start_forms`. With the choice stored for this engine's key
     (the forms file beside the compilation cache) every bucket runs its stored form
     from the start and nothing is measured. With a cold file every bucket runs a
     fallback: the newest choice stored for this model under another key (other
     shapes, another device), else the first candidate (float where the weight
     budget holds it, else dequant); the measuring programs (every form at each
     bucket's measuring shape) join the background compiles, and the engine is
     ready with the fallback's first programs only.
  3. The caller (the worker's decoder runner, between steps) asks `forms_due` and
     calls `measure_forms`: one (bucket, form) at a time, on the engine thread, on
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

import numpy as np

from shared.logging import get_logger

log = get_logger(__name__)
FORM_REPEATS = 3  # timed runs of a (bucket, form), after one untimed run


class FormChoice:
    """The per-bucket compute forms of `DecoderEngine` (see the module docstring)."""

    def _load_forms(self, budget: int, cache, weights_cache) -> None:
        """Weights in every compute form this engine may run (engine/forms.py); until
        `warmup` every bucket runs the forced form, or the stored one."""
        from engine import forms, prepared
        from engine.decoder.model import load_param_forms

        want = ("float",) if self.quant == "none" else ("dequant",)
        if self.quant == "int8" and self.quant_form in ("auto", "w8a8"):
            want += ("w8a8",)
        trees = load_param_forms(self.model_dir, self.cfg, self._jdtype, self.quant, want,
                                 self._mesh, prepared.directory(weights_cache))  # fmt: skip
        if self.quant != "none":
            self.form_candidates = forms.add_forms(trees, self.quant, self.quant_form, budget,
                                                   self._jdtype, self._mesh)  # fmt: skip
        else:
            self.form_candidates = ("float",)
        self._forms = {f: t for f, t in trees.items() if f in self.form_candidates}
        self._forms_cache = forms.cache_path(cache)
        first = self.form_candidates[0] if len(self.form_candidates) == 1 else "dequant"
        self.compute_forms: dict[str, str] = {b: first for b in self.form_buckets}
        self.form_ms: dict[str, dict[str, float]] = {}  # bucket -> form -> ms measured
        self.forms_measured = False  # whether this engine measured (and stored) its choice
        self.form_measurements = 0  # (bucket, form) pairs measured so far
        self.form_units = 0  # (bucket, form) pairs it measures in all (0: none)
        self._todo: list[tuple[str, str]] = []  # (bucket, form) still to measure
        self._winners: dict[str, str] = {}  # bucket -> its measured (or stored) form
        self._forms_key: tuple[dict, str] | None = None
        self._forms_started = False  # `_start_forms` ran
        self._forms_final = len(self._forms) == 1  # each bucket runs its choice, the rest dropped
        self.params = self._forms[first]  # the decode step's weights (benchmarks, tests)

    @property
    def form_buckets(self) -> list[str]:
        """Buckets a compute form is chosen for: each decode batch bucket (at any
        window) and each prefill length."""
        return [f"step {b}" for b in self.batches] + [f"prefill {b}" for b in self.buckets]

    def _params_for(self, bucket: str) -> dict:
        return self._forms[self.compute_forms[bucket]]

    def _key_fields(self) -> tuple[dict, str]:
        from engine import forms

        if self._forms_key is None:
            cfg = self.cfg
            fields = dict(model=self.name, family=cfg.family, layers=cfg.layers,
                          hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                          intermediate=cfg.intermediate, vocab=cfg.vocab_size,
                          dtype=self._dtype, quant=self.quant, tp=cfg.tensor_parallel,
                          windows=list(self.windows), contexts=list(self.contexts),
                          batches=list(self.batches))  # fmt: skip
            self._forms_key = fields, forms.key_of(fields, self.form_buckets, tuple(self._forms))
        return self._forms_key

    # ------------------------------------------------------------------ start
    def _start_forms(self) -> list[tuple[tuple[str, int, int], str]]:
        """Each bucket's form at warm-up: the stored choice, else a fallback while
        the measuring waits for after ready -> the measuring programs, (shape, form),
        for the background compiles (none when nothing is measured)."""
        from engine import forms

        if self._forms_started:
            return []
        self._forms_started = True
        if len(self._forms) == 1:
            self._forms_final = True
            self._log_forms()
            return []
        fields, key = self._key_fields()
        entry = forms.lookup(key, self.form_buckets, self._forms_cache)
        if entry is not None:  # warm: nothing compiled yet, so every bucket switches now
            self.form_ms, self._winners = entry.get("ms", {}), dict(entry["choices"])
            self._settle(at_once=True)
            return []
        last = forms.last_choice(self.name, self._forms_cache)
        first = self.form_candidates[0]
        self.compute_forms = {b: last[b] if last.get(b) in self._forms else first
                              for b in self.form_buckets}  # fmt: skip
        self.params = self._params_for(f"step {self.batches[-1]}")
        self._todo = [(b, f) for b in self.form_buckets for f in self._forms]
        self.form_units = len(self._todo)
        log.info("compute_forms_fallback", model=self.name, quant=self.quant,
                 forms=self.compute_forms, measuring=self.form_units,
                 cache=str(self._forms_cache or ""))  # fmt: skip
        return [(self._measure_shape(b), f) for b, f in self._todo]

    def _measure_shape(self, bucket: str) -> tuple[str, int, int]:
        """The shape a bucket is measured at: the step at its smallest window, a
        prefill chunk at its smallest context."""
        kind, size = bucket.split()
        other = self.windows[0] if kind == "step" else self.context_for(int(size))
        return kind, int(size), other

    @property
    def forms_settled(self) -> bool:
        """Every bucket runs its choice (nothing left to measure or to switch; set
        last, so another thread may read it)."""
        return self._forms_final

    def forms_progress(self) -> tuple[int, int]:
        """((bucket, form) pairs measured, pairs to measure); (0, 0): none measured."""
        return self.form_measurements, self.form_units

    def weight_forms(self) -> tuple[str, dict[str, str]]:
        return self.quant, dict(self.compute_forms)

    # -------------------------------------------------------------- measuring
    def select_forms(self) -> dict[str, str]:
        """Every bucket's form now, measuring what the file does not hold, compiling
        where needed (benchmarks, tests); the worker measures after ready instead."""
        self._start_forms()
        while self._todo:
            self._measure_unit(*self._todo[0])
        self._settle(at_once=True)
        return dict(self.compute_forms)

    def forms_due(self) -> bool:
        """Whether `measure_forms` has work it can do now without compiling here."""
        return self._next_unit() is not None or any(self._switchable(b) for b in self._pending())

    def measure_forms(self, limit: int = 1) -> int:
        """Measure up to `limit` (bucket, form) pairs whose programs are compiled,
        then switch the buckets that may switch -> pairs measured. On the engine
        thread, between steps."""
        done = 0
        while done < limit and (unit := self._next_unit()) is not None:
            self._measure_unit(*unit, tolerant=True)
            done += 1
        self._settle(at_once=self.compile_ahead == "lazy")
        return done

    def _next_unit(self) -> tuple[str, str] | None:
        inline = not self.programs.compiling  # nothing will compile it for us
        for bucket, form in self._todo:
            if inline or self.programs.has((*self._measure_shape(bucket), form)):
                return bucket, form
        return None

    def _timed(self, bucket: str, form: str) -> float:
        from engine import forms

        return forms.timed(lambda: self._run_form(bucket, form), FORM_REPEATS)

    def _run_form(self, bucket: str, form: str):
        """One run of `bucket`'s measuring program in `form`, on the dummy row."""
        kind, size, other = self._measure_shape(bucket)
        params, run = self._forms[form], self._program(kind, size, other, form)
        if kind == "step":
            rows = np.full(size, self._slots, np.int32)  # [B]: all the dummy row
            tables = self._tables[rows, : other // self.block]  # [B, NW]
            self._state, out = run(params, self._state, rows, tables, rows < self._slots)
            return out
        table = np.array(self._tables[self._slots, : other // self.block])  # [NC]
        self._state, token = run(params, self._state, np.zeros(size, np.int32), np.int32(0),
                                 np.int32(size), table, np.int32(self._slots),
                                 self._warm_sampling, np.uint32(0))  # fmt: skip
        return token

    def _measure_unit(self, bucket: str, form: str, tolerant: bool = False) -> None:
        """Time one (bucket, form); `tolerant`: a form that fails here is recorded as
        never fastest (it would fail where it runs too) instead of raising."""
        try:
            ms = round(self._timed(bucket, form), 3)
        except Exception as exc:
            if not tolerant:
                raise
            log.warning("form_measure_failed", model=self.name, bucket=bucket, form=form,
                        error=repr(exc))  # fmt: skip
            ms = float("inf")
        self._todo.remove((bucket, form))
        self._record(bucket, form, ms)

    def _record(self, bucket: str, form: str, ms: float) -> None:
        from engine import forms

        self.form_measurements += 1
        self.form_ms.setdefault(bucket, {})[form] = ms
        if any(b == bucket for b, _ in self._todo):
            return
        self._winners[bucket] = winner = forms.fastest(self.form_ms[bucket])
        if winner != self.compute_forms[bucket] and self.compile_ahead != "lazy":
            shapes = self._bucket_shapes(bucket)
            held = [k for k in shapes if self.programs.has((*k, self.compute_forms[bucket]))]
            order = held + [k for k in shapes if k not in held]
            self._compile_background([(k, winner) for k in order], first=True)
        if not self._todo:
            fields, key = self._key_fields()
            try:
                forms.store(self._forms_cache, key, fields, dict(self._winners), self.form_ms)
            except OSError as exc:  # served as chosen all the same; the next start measures
                log.warning("compute_forms_not_stored", model=self.name, error=repr(exc))
            self.forms_measured = True

    # -------------------------------------------------------------- switching
    def _bucket_shapes(self, bucket: str) -> list[tuple[str, int, int]]:
        return [k for k in self.compiles if self._form_bucket(k[0], k[1]) == bucket]

    def _pending(self) -> list[str]:
        return [b for b, f in self._winners.items() if self.compute_forms[b] != f]

    def _switchable(self, bucket: str) -> bool:
        """Whether the chosen form has every program of `bucket` its form has now."""
        now, new = self.compute_forms[bucket], self._winners[bucket]
        return all(self.programs.has((*k, new)) for k in self._bucket_shapes(bucket)
                   if self.programs.has((*k, now)))

    def _settle(self, at_once: bool = False) -> None:
        """Switch the buckets whose choice may run now; once every bucket runs its
        choice, drop the forms (weights, programs) nothing runs."""
        from engine import forms

        switched = [b for b in self._pending() if at_once or self._switchable(b)]
        for bucket in switched:
            self.compute_forms[bucket] = self._winners[bucket]
            masked = self.grammar.built  # structured outputs' twins
            if masked is not None and self.compile_ahead != "lazy":
                masked.start_background([k for k in self._bucket_shapes(bucket)
                                         if k[0] in ("step", "prefill")])  # fmt: skip
        if switched:
            log.info("compute_form_switched", model=self.name,
                     forms={b: self.compute_forms[b] for b in switched})  # fmt: skip
        if self._todo or self._pending() or self._forms_final:
            if switched:
                self.programs.drop(self._keeps)
            return
        self._forms_final = True
        used = set(self.compute_forms.values())
        self._forms = {f: t for f, t in self._forms.items() if f in used}
        self.params = self._params_for(f"step {self.batches[-1]}")
        self.weight_bytes = forms.held_bytes(self._forms)
        self.programs.drop(self._keeps)
        self._log_forms()

    def _keeps(self, key) -> bool:
        """Whether a compiled program is still wanted: its bucket runs its form, will
        switch to it, or has it still to measure."""
        kind, size, _, form = key
        bucket = self._form_bucket(kind, size)
        return (form == self.compute_forms[bucket] or form == self._winners.get(bucket)
                or (bucket, form) in self._todo)  # fmt: skip

    def _log_forms(self) -> None:
        log.info("compute_forms", model=self.name, quant=self.quant, choices=self.compute_forms,
                 ms=self.form_ms, measured=self.forms_measured, weight_bytes=self.weight_bytes,
                 cache=str(self._forms_cache or ""))  # fmt: skip
