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

import jax
import numpy as np

from engine.decoder import steps
from engine.decoder.programs import Programs


class MaskedPrograms:
    def __init__(self, engine, width: int) -> None:
        from engine import sharding

        self._engine = engine  # a weak proxy (engine.decoder.grammar.SlotGrammars)
        self.width = width  # int32 words per mask row
        cfg = engine.cfg
        out = {}
        if engine._mesh is not None:
            state_sharding = sharding.state_sharding(engine._state, engine._mesh)
            out = {"out_shardings": (state_sharding, sharding.replicated(engine._mesh))}
        kernel, interpret = engine.attention, jax.devices()[0].platform == "cpu"
        self._prefill = jax.jit(
            lambda params, state, *args: steps.prefill_chunk(params, cfg, state, *args[:-1],
                                                             mask=args[-1]),
            donate_argnums=1, **out)  # fmt: skip
        self._generate = jax.jit(
            lambda params, state, rows, tables, live, mask: steps.generate(
                params, cfg, state, rows, tables, live, kernel, interpret, mask=mask),
            donate_argnums=1, **out)  # fmt: skip
        self.programs = Programs(f"{engine.name}-masked")

    def _job(self, kind: str, size: int, other: int):
        """(key, lower) of the masked program of one shape."""
        engine = self._engine
        bucket = f"{kind} {size}"
        params = engine._params_for(bucket)
        lower = self._lower_step if kind == "step" else self._lower_prefill
        return (kind, size, other, engine.compute_forms[bucket]), lambda: lower(params, size, other)

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
        engine = self._engine
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        args = (i32(batch), i32(batch, window // engine.block),
                jax.ShapeDtypeStruct((batch,), np.bool_), i32(batch, self.width))
        return self._generate.lower(params, engine._state_spec, *args)

    def _lower_prefill(self, params, bucket: int, ctx: int):
        engine = self._engine
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        sampling = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                engine._warm_sampling)
        args = (i32(bucket), i32(), i32(), i32(ctx // engine.block), i32(), sampling,
                jax.ShapeDtypeStruct((), np.uint32), i32(self.width))
        return self._prefill.lower(params, engine._state_spec, *args)
