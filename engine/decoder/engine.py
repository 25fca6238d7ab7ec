"""The JAX decoder engine: the parts it owns, and the calls a worker makes on it.

Parts (each built here, with what it needs passed in; none inherits another):
  - `SlotTable` (slots.py): the KV block pool and each slot's blocks, lengths,
    tokens and prefill progress; host only.
  - `FormChoice` (formchoice.py): the weights of each compute form and which form
    each bucket runs, measured after ready when no choice is stored.
  - `StepPrograms` (compiled.py): the shapes served, their jitted functions, the
    compiled programs (programs.py) and which one runs a piece of work.
  - `StepRunner` (runner.py): the decode state on the device; prefill chunks,
    decode steps, block copies; the step in flight.
  - `SlotGrammars` (grammar.py): structured outputs' matchers and their token masks.
  - `Speculation` (speculative.py): prompt-lookup drafts for a lone stream.

Dataflow of a served sequence:
  1. `begin(slot, prompt, sampling, seed)`: the table gives the slot its blocks,
     reusing a cached prefix (a shared partial block is copied by the runner);
     False when the pool has no room now.
  2. `prefill_step(slot, budget)`: the runner computes the next chunk; the last one
     draws the first token and the slot goes live. With `mix`, the chunk rides in
     the next step's pass instead (a mixed step, the CPU kernel's), and its first
     token comes with that step's result.
  3. `make_room(victim)`: every live slot gets the block its next step writes into;
     while the pool is short, the caller's policy names a sequence to preempt.
     Then `step_async()`: a speculative verify pass for a lone plain stream when a
     draft is found, else one decode step of the live slots, read later.
  4. `free(slot)`: its blocks go back to the pool, full ones keyed for reuse.

Compiles: `warmup()` compiles what a first request needs and, with
`compile_ahead="first"`, the rest on a background thread, cheapest first
(structured outputs run on the same programs: a token mask is one of their
arguments); until a shape is compiled the
smallest compiled one that holds the work stands in.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
from tqdm import tqdm

from engine import forms as form_sets
from engine import jaxrt
from engine import sharding
from engine.decoder import attention as attention_kernel
from engine.decoder import host, shapes
from engine.decoder.compiled import Shape, StepPrograms
from engine.decoder.config import load_config
from engine.decoder.formchoice import FormChoice
from engine.decoder.grammar import SlotGrammars
from engine.decoder.kvcache import block_bytes, cache_bytes, init_decode_state, slot_sampling
from engine.decoder.runner import PendingStep, StepRunner
from engine.decoder.scoring import prompt_logprobs
from engine.decoder.speculative import Speculation
from engine.decoder.slots import SlotTable
from engine.interface import CacheStats, DecoderStats, SpecStats, Victim
from engine.jaxrt import device_name, dtype_name, parse_dtype
from engine.quant import check_mode
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger(__name__)
DEFAULT_BUCKETS = (1, 16, 32, 64, 128, 256, 512)
COMPILE_AHEAD = ("all", "first", "lazy")
GREEDY = Sampling(temperature=0.0)


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
        mixed_steps: bool = True,
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
        allowed per bucket, chosen after ready) or one of engine/forms.py's;
        weight_budget: bytes all held forms' weights may take (0: float32 size);
        forms_cache: the choice's file ("": beside the compilation cache; None: not
        kept); weights_cache: the prepared weights' folder (engine/prepared.py), ""
        and None alike. compile_ahead: what `warmup` compiles before it returns:
        "all", or what a first request needs, the rest on a background thread
        ("first") or where first needed ("lazy": tests and benchmarks). attention:
        the decode step's paged attention (engine/decoder/attention.py).
        speculative: draft tokens per step of a lone stream's prompt-lookup
        speculation (engine/decoder/speculative.py; 0: off). mixed_steps: on the
        CPU kernel, prompt chunks ride in the decode step's pass (steps.py `mixed`)."""
        t0 = time.perf_counter()
        if compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"compile_ahead {compile_ahead!r}: use one of {', '.join(COMPILE_AHEAD)}")
        self.compile_ahead = compile_ahead
        self.quant = check_mode(quant)
        quant_form = form_sets.check_form(quant_form, self.quant)
        tp = sharding.parse(tensor_parallel)
        cfg = load_config(model_dir)
        if tp > 1:
            sharding.check_divisible(name, tp, query_heads=cfg.heads, kv_heads=cfg.kv_heads,
                                     mlp_columns=cfg.intermediate)  # fmt: skip
        mesh = sharding.make_mesh(tp)
        self.cfg = cfg = dataclasses.replace(cfg, tensor_parallel=tp)
        self.model_dir = Path(model_dir)
        self.name = name
        self._jdtype = parse_dtype(dtype)
        block = int(kv_block)
        info = host.describe(name, model_dir, cfg, dtype_name(dtype), slots, max_context,
                             sharding.engine_devices(mesh), device_name(),
                             prefix_block=block if prefix_cache else 0)  # fmt: skip
        self.info = info
        kernel = attention_kernel.pick(attention, jax.devices()[0].platform, tp)
        windows = shapes.decode_windows(decode_windows, info.max_context, block)
        if kernel in attention_kernel.IN_PLACE:  # it reads what rows hold: no window axis
            windows = windows[-1:]
        batches = shapes.decode_batches(info.slots)
        chunk = min(int(prefill_chunk) or max(prefill_buckets), windows[-1])
        buckets = shapes.prefill_buckets(tuple(prefill_buckets), chunk)
        # Contexts a prefill chunk may attend to: every other decode window and the
        # largest (fewer compiles; a chunk reads at most one step up).
        contexts = tuple(sorted(w for i, w in enumerate(reversed(windows)) if i % 2 == 0))
        self.forms = FormChoice(
            name, model_dir, cfg, info.dtype, self._jdtype, self.quant, quant_form, mesh,
            weight_budget, forms_cache, weights_cache,
            [f"step {b}" for b in batches] + [f"prefill {b}" for b in buckets],
            dict(windows=list(windows), contexts=list(contexts), batches=list(batches)),
            compile_ahead)  # fmt: skip
        max_blocks = windows[-1] // block  # a table's width: a full context
        blocks = int(kv_blocks) or info.slots * max_blocks + 1
        self.table = SlotTable(info.slots, block, max_blocks, info.max_context, blocks,
                               prefix_cache)  # fmt: skip
        state = init_decode_state(cfg, info.slots, blocks, block, self._jdtype)
        warm_sampling = slot_sampling(GREEDY, cfg.vocab_size, [])  # warm-up, lowering
        # Sharded: the state keeps its layout across calls (the KV pool split by KV
        # head, the rest replicated), so each step's output is the next step's input.
        jit_kw = {}
        if mesh is not None:
            state_sharding = sharding.state_sharding(state, mesh)
            state = jax.device_put(state, state_sharding)
            jit_kw = {"out_shardings": (state_sharding, sharding.replicated(mesh))}
        sampling_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                     warm_sampling)  # fmt: skip
        self.programs = StepPrograms(
            name, cfg, self.forms, shapes.spec(state), sampling_spec, block, buckets,
            contexts, batches, windows, int(speculative), kernel, jit_kw, mixed_steps)  # fmt: skip
        self.grammar = SlotGrammars(name, info.slots, cfg.vocab_size, info.tokenizer,
                                    info.eos_token_ids, on_release=self._grammar_released)  # fmt: skip
        self.runner = StepRunner(state, self.table, self.programs, self.forms, self.grammar,
                                 warm_sampling, chunk)  # fmt: skip
        self.speculation = Speculation(speculative, self.table, self.programs, self.runner)
        self._riding: list[tuple[int, int]] = []  # chunks handed to the next step (prefill_step)
        self._bytes = block_bytes(cfg, block, self._jdtype)
        jaxrt.release_freed_memory()  # the weights' intermediate arrays, freed by now
        log.info(
            "decoder_loaded", model=name, family=cfg.family, dtype=info.dtype,
            quant=self.quant, forms=list(self.forms.held), devices=list(info.devices),
            slots=info.slots, max_context=info.max_context, buckets=list(buckets),
            windows=list(windows), batches=list(batches), attention=kernel,
            contexts=list(contexts), kv_block=block, kv_blocks=blocks,
            speculative=self.speculation.k, param_bytes=self.forms.weight_bytes,
            cache_bytes=cache_bytes(state), seconds=round(time.perf_counter() - t0, 3),
        )  # fmt: skip

    # ------------------------------------------------------------- shorthands
    @property
    def slots(self) -> int:
        return self.info.slots

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def device(self) -> str:
        return self.info.device

    @property
    def devices(self) -> list[str]:
        return list(self.info.devices)

    @property
    def params(self) -> dict:
        """The largest decode step's weights (benchmarks, tests, prompt scoring)."""
        return self.forms.params

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block, every layer."""
        return self._bytes

    # ----------------------------------------------------------------- warm-up
    def warmup(self, progress: bool = True) -> int:
        """Compile what `compile_ahead` says and run each once; with "first", the rest
        on a background thread. Return how
        many programs were compiled here."""
        programs = self.programs
        background = self.compile_ahead == "first"
        measuring = self.forms.start(programs) if self.quant != "none" else []
        jobs = programs.compiles if self.compile_ahead == "all" else programs.first_compiles()
        t0 = time.perf_counter()
        bar = tqdm(total=len(jobs), desc=f"compile {self.name}", file=sys.stderr,
                   disable=not progress)  # fmt: skip

        def compiled(key) -> None:
            bar.set_postfix_str(" ".join(map(str, key[:3])))
            bar.update()

        programs.cache.compile_together([(programs.key(*j), programs.lowering(*j)) for j in jobs],
                                        compiled)  # fmt: skip
        bar.close()
        for job in jobs:  # each once: its first run's one-time costs leave the serving path
            self.runner.warm(*job)
        self.runner.copy(0, 0)  # the scratch block onto itself: compiles the copy
        if programs.mixed_shapes:
            self.runner.claim_dummy()  # compiles the claim a mixed step's last chunks run
        if self.compile_ahead != "lazy" and (background or measuring):
            # The programs the forms are measured with first (formchoice.py), then
            # the rest, cheapest first (one stream at every window is in the first set).
            done = set(jobs)
            rest: list[tuple[Shape, str | None]] = [
                (k, None) for k in programs.compiles if k not in done] if background else []
            programs.compile_background(measuring + rest)
        log.info("decoder_warm", model=self.name, compiled=len(jobs), background=background,
                 total=len(programs.compiles), measuring=len(measuring),
                 seconds=round(time.perf_counter() - t0, 3))
        return len(jobs)

    def on_compiled(self, callback: Callable[[], None]) -> None:
        self.programs.cache.listeners.append(callback)

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop compiling in the background (the engine is being dropped, or its
        process exits); `wait_s`: wait that long for the program being compiled.
        False: one still was. A process must not exit while XLA compiles on the
        daemon thread: the interpreter's exit unwinds that thread through C++ frames
        and the process aborts (SIGABRT) instead of exiting 0."""
        cache = self.programs.cache
        cache.stop()
        return cache.wait_background(wait_s) if wait_s > 0 else not cache.compiling

    # ---------------------------------------------------------------- requests
    def check(self, prompt: list[int], sampling: Sampling | None = None) -> None:
        """ValueError if the prompt cannot be served (the JAX engine applies every
        sampling control)."""
        host.check_prompt(self.info, prompt)
        self.table.check_prompt(prompt, self.name)

    def prompt_logprobs(self, tokens: list[int], top: int) -> list[tuple[int, float, list, int]]:
        """Each prompt token's logprob given those before it, and the `top` most
        likely there (engine/decoder/scoring.py); one pass, no slot touched."""
        return prompt_logprobs(self.params, self.cfg, tokens, top)

    def can_admit(self, prompt: list[int]) -> bool:
        return self.table.can_admit(prompt)

    def begin(self, slot: int, prompt: list[int], sampling: Sampling, seed: int,
              generated: int = 0) -> bool:
        host.check_slot(self.info, slot)
        self.check(prompt)
        if not self.table.can_admit(prompt):
            return False
        copy = self.table.begin(slot, prompt, slot_sampling(sampling, self.cfg.vocab_size, prompt),
                                seed, sampling.logprobs)  # fmt: skip
        if copy is not None:
            self.runner.copy(*copy)
        self.grammar.begin(slot, sampling.grammar, prompt[len(prompt) - generated:],
                           max(0, sampling.min_tokens - generated), sampling.stop_token_ids)
        self.speculation.begin(slot, sampling)
        return True

    def prefilling(self, slot: int) -> int:
        return self.table.prefilling(slot)

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False) -> int | None:
        """The next chunk of `slot`'s prompt now; with `mix`, in the next
        `step_async`'s pass instead when there is a step to share and a compiled
        mixed program holds its rows (steps.py `mixed`): then None, and once that
        step is dispatched `prefilling(slot)` says how far it went (0: the prompt is
        done, its first token comes with that step's result). A grammar that does
        not compile raises here, not in the step."""
        table = self.table
        live = int(table.active.sum())
        if any(s == slot for s, _ in self._riding):
            return None  # already handed to the next step
        if mix and live and self.programs.mixed_shape(live, live + len(self._riding) + 1):
            if table.prefilling(slot) <= (budget or self.runner.chunk):
                self.grammar.first_mask(slot)  # may be its last chunk: its matcher, now
            self._riding.append((slot, budget))
            return None
        return self.runner.prefill(slot, budget)

    def mixes(self) -> bool:
        """Whether a mixed step may run: on the CPU kernel, once one of their programs
        is compiled (the background compiles them first; never on the serving path)."""
        return self.programs.mixed_shape(0, 1) is not None

    def make_room(self, victim: Victim) -> list[int]:
        preempted: list[int] = []
        while self.table.grow():
            holders = self.table.holders()
            slot = victim(holders)
            if slot not in holders:
                raise ValueError(f"the preemption policy named slot {slot}, which holds no cache")
            self.free(slot, preempted=True)
            preempted.append(slot)
        return preempted

    def step_async(self) -> PendingStep | None:
        """Dispatch one decode step and return at once; `.result()` waits for it.

        Lets a caller do host work (detokenize, publish) while the device computes.
        Calls made before `.result()` queue behind the step on the device, so a slot
        begun meanwhile is not part of this step: ignore its entry in the result.
        RuntimeError when a live slot has no block for its next token (`make_room`
        first)."""
        table, riding = self.table, self._riding
        riding = [(s, n) for s, n in riding if table.prefilling(s)]  # not taken back since
        self._riding = []
        if not table.active.any() and not riding:
            return None
        if table.grow():
            raise RuntimeError("the KV pool is full: call make_room before the step")
        if riding:
            live = int(table.active.sum())
            shape = self.programs.mixed_shape(live, live + len(riding))
            if shape is not None:  # else they wait for the next call
                return self.runner.mixed(riding, shape)
            if not live:
                return None
        return self.speculation.step() or self.runner.step()

    def step(self):
        """One decode step, read (tests and benchmarks) -> [slots] int32."""
        pending = self.step_async()
        if pending is None:
            raise RuntimeError("no slot is live")
        return pending.result()

    def free(self, slot: int, preempted: bool = False) -> None:
        self.table.free(slot, preempted)
        self.grammar.free(slot)

    def context_left(self, slot: int) -> int:
        return self.table.context_left(slot)

    def token_logprobs(self, slot: int):
        return self.table.token_logprobs(slot)

    def _grammar_released(self, slot: int) -> None:
        self.speculation.released(slot)

    # ------------------------------------------------------------------ stats
    def stats(self, prefixes: int = 0) -> DecoderStats:
        compiled, total = self.programs.progress()
        caches = [self.programs.cache]
        return DecoderStats(
            active=int(self.table.active.sum()), cache=self.cache_stats(),
            spec=self.speculation.counts(), compiled=compiled, programs=total,
            compiling=any(c.waited_on for c in caches),
            compile_waited_s=sum(c.waited_s for c in caches),
            forms_measured=self.forms.measurements, forms_total=self.forms.units,
            quant=self.quant, compute_forms=dict(self.forms.compute_forms),
            tune_due=self.forms.due(self.programs),
            prefixes=self.table.pool.summary(prefixes) if prefixes else [],
        )  # fmt: skip

    def cache_stats(self) -> CacheStats:
        return self.table.cache_stats()

    def speculation_stats(self) -> SpecStats:
        return self.speculation.counts()

    # ------------------------------------------------------------ compute forms
    def tune(self, limit: int = 1) -> int:
        """Measure up to `limit` (bucket, form) pairs and switch the buckets that may
        switch (engine/decoder/formchoice.py) -> pairs measured."""
        return self.forms.measure(self.programs, self.runner.run_form, limit)

    def select_forms(self) -> dict[str, str]:
        """Every bucket's form now, measured here where not stored (tests, benchmarks)."""
        return self.forms.select(self.programs, self.runner.run_form)
