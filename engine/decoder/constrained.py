"""The masked programs of structured outputs: the engine's prefill chunk and decode
step with one more argument, each row's token mask (engine/decoder/grammar.py),
applied to the logits after the penalties and before temperature, top-k, top-p,
min-p and the draw (so a filter never leaves a row with nothing allowed).

They are separate programs, kept apart from the engine's own (`Programs` of their
own): a step with no constrained row runs the engine's program exactly as before.
A worker that compiles ahead compiles every one after its warm-up
(`SlotGrammars.prepare_background`); otherwise each is compiled where first
needed. Same donation and shardings as the engine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from engine.programs import Programs
from engine.decoder.shapes import i32
from engine.decoder.steps import generate, prefill_chunk

if TYPE_CHECKING:
    from engine.decoder.compiled import StepPrograms


class MaskedPrograms:
    def __init__(self, steps: StepPrograms, width: int) -> None:
        self._steps = steps  # the engine's own programs: shapes, forms, shardings
        self.width = width  # int32 words per mask row
        cfg, kernel, interpret = steps.cfg, steps.attention, steps.interpret
        self._prefill = jax.jit(
            lambda params, state, *args: prefill_chunk(params, cfg, state, *args[:-1],
                                                       mask=args[-1], kernel=kernel),
            donate_argnums=1, **steps.jit_kw)  # fmt: skip
        self._generate = jax.jit(
            lambda params, state, rows, tables, live, mask: generate(
                params, cfg, state, rows, tables, live, kernel, interpret, mask=mask),
            donate_argnums=1, **steps.jit_kw)  # fmt: skip
        self.programs = Programs(f"{steps.name}-masked")

    def _job(self, kind: str, size: int, other: int):
        """(key, lower) of the masked program of one shape."""
        form = self._steps.forms.form_of(kind, size)
        params = self._steps.forms.params_of(form)
        lower = self._lower_step if kind == "step" else self._lower_prefill
        return (kind, size, other, form), lambda: lower(params, size, other)

    def start_background(self, shapes: list[tuple[str, int, int]]) -> None:
        """Compile the masked programs of `shapes` on a thread of their own."""
        self.programs.start_background([self._job(*s) for s in shapes])

    def compile(self, shapes: list[tuple[str, int, int]]) -> None:
        """Compile the masked programs of `shapes` now, in order."""
        for shape in shapes:
            self.programs.get(*self._job(*shape))

    def step(self, batch: int, window: int):
        """The masked step at (batch bucket, window): (params, state, rows, tables,
        live, masks [B, W] int32) -> (state, packed)."""
        return self.programs.get(*self._job("step", batch, window))

    def prefill(self, bucket: int, ctx: int):
        """The masked prefill chunk: the engine's arguments, then the mask [W] int32."""
        return self.programs.get(*self._job("prefill", bucket, ctx))

    def _lower_step(self, params, batch: int, window: int):
        steps = self._steps
        args = (i32(batch), i32(batch, window // steps.block),
                jax.ShapeDtypeStruct((batch,), np.bool_), i32(batch, self.width))
        return self._generate.lower(params, steps.state_spec, *args)

    def _lower_prefill(self, params, bucket: int, ctx: int):
        steps = self._steps
        args = (i32(bucket), i32(), i32(), i32(ctx // steps.block), i32(), steps.sampling_spec,
                jax.ShapeDtypeStruct((), np.uint32), i32(self.width))
        return self._prefill.lower(params, steps.state_spec, *args)
