"""Host-side driver of the decoder engine: what a worker calls, from one thread.

Dataflow of a served sequence:
  1. `prefill_insert(slot, prompt, sampling, seed)`: the prompt is padded to the
     smallest length bucket that holds it; one jitted call (compiled per bucket at
     warm-up) runs the prompt, writes its K/V into `slot` of the preallocated cache,
     draws the first token with the request's own seeded key, and returns it.
  2. `step()`: one jitted decode step for every slot at once (each at its own
     position, with its own sampling parameters); the state is donated, so the cache
     is updated in place; one [SLOTS] int32 array comes back to the host.
  3. The caller decides when a sequence ends (EOS, stop string, max tokens,
     `context_left(slot) == 0`) and calls `free(slot)`; the slot's cache rows are
     simply overwritten by the next insert.

Compiles: one per prefill bucket plus one per decode attention window (the step
attends to the smallest window that holds every active sequence: reading the cache
is most of a step's cost), all at `warmup()`. Nothing else compiles afterwards:
every per-request value (slot, length, seed, sampling) is traced.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

from engine.decoder.config import DecoderConfig, load_config
from engine.decoder.kvcache import SlotSampling, cache_bytes, init_decode_state
from engine.decoder.model import load_params, param_bytes
from engine.decoder.steps import generate, prefill_insert
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger(__name__)
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)
GREEDY = Sampling(temperature=0.0)


def _windows(requested: tuple[int, ...] | None, max_context: int) -> tuple[int, ...]:
    """Attention windows of the decode step: powers of two from 128, and the context."""
    if requested is None:
        requested = tuple(2**i for i in range(7, 16))
    return tuple(sorted({w for w in requested if 0 < w < max_context} | {max_context}))


def _buckets(requested: tuple[int, ...], max_context: int) -> tuple[int, ...]:
    """Buckets up to max_context, and always one that holds the longest prompt."""
    out = sorted({b for b in requested if 0 < b < max_context})
    if not out or out[-1] < max_context - 1:
        out.append(max_context)
    return tuple(out)


class PendingStep:
    """A dispatched decode step; its tokens leave the device on `result()`."""

    def __init__(self, tokens: jax.Array) -> None:
        self._tokens = tokens  # [SLOTS] int32, on device
        self._host: np.ndarray | None = None

    def result(self) -> np.ndarray:
        if self._host is None:
            self._host = np.asarray(self._tokens)  # the step's one host copy
        return self._host


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
    ) -> None:
        from engine.jaxrt import device_name, dtype_name, parse_dtype

        t0 = time.perf_counter()
        self.name = name
        self.model_dir = Path(model_dir)
        self.cfg: DecoderConfig = load_config(model_dir)
        limit = min(self.cfg.max_positions, self.cfg.sliding_window or self.cfg.max_positions)
        if max_context > limit:
            log.warning("max_context_capped", requested=max_context, limit=limit)
        self._max_context = min(int(max_context), limit)
        if self._max_context < 2:
            raise ValueError("max_context must be at least 2")
        self._slots = int(slots)
        self._dtype = dtype_name(dtype)
        self._jdtype = parse_dtype(dtype)
        self.buckets = _buckets(tuple(prefill_buckets), self._max_context)
        self.windows = _windows(decode_windows, self._max_context)
        self.device = device_name()
        self.tokenizer = self._load_tokenizer()
        self.params = load_params(model_dir, self.cfg, self._jdtype)
        self._state = init_decode_state(self.cfg, self._slots, self._max_context, self._jdtype)
        cfg = self.cfg
        # state is the argument after params in both: donated, so updated in place.
        self._prefill_insert = jax.jit(
            lambda params, state, *args: prefill_insert(params, cfg, state, *args),
            donate_argnums=1,
        )
        self._generate = jax.jit(
            lambda params, state, window: generate(params, cfg, state, window),
            donate_argnums=1,
            static_argnums=2,
        )
        self._lengths = np.zeros(self._slots, np.int64)  # tokens in context per slot
        self._active = np.zeros(self._slots, bool)
        log.info(
            "decoder_loaded", model=name, family=self.cfg.family, dtype=self._dtype,
            slots=self._slots, max_context=self._max_context, buckets=list(self.buckets),
            windows=list(self.windows),
            param_bytes=param_bytes(self.params), cache_bytes=cache_bytes(self._state),
            seconds=round(time.perf_counter() - t0, 3),
        )  # fmt: skip

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
        """Fraction of the cache's positions held by active sequences."""
        used = int(self._lengths[self._active].sum())
        return used / (self._slots * self._max_context)

    @property
    def active_slots(self) -> int:
        return int(self._active.sum())

    def context_left(self, slot: int) -> int:
        """Tokens `slot` can still generate before its context is full."""
        return int(self._max_context - self._lengths[slot])

    # ----------------------------------------------------------------- warmup
    def warmup(self, progress: bool = True) -> int:
        """Compile every prefill bucket and every decode window; return how many."""
        from tqdm import tqdm

        jobs = [("prefill", b) for b in self.buckets] + [("step", w) for w in self.windows]
        bar = tqdm(jobs, desc=f"compile {self.name}", file=sys.stderr, disable=not progress)
        t0 = time.perf_counter()
        for kind, size in bar:
            bar.set_postfix_str(f"{kind} {size}")
            if kind == "prefill":
                self._run_prefill(0, [0] * min(size, self._max_context - 1), GREEDY, 0)
            else:
                jax.block_until_ready(self._run_step(size))
        self._active[:] = False
        self._lengths[:] = 0
        log.info("decoder_warm", model=self.name, compiled=len(jobs),
                 seconds=round(time.perf_counter() - t0, 3))  # fmt: skip
        return len(jobs)

    # -------------------------------------------------------------- requests
    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(f"no bucket holds {length} tokens")  # unreachable after checks

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(prompt) > self._max_context - 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {self.name} accepts at most "
                f"{self._max_context - 1} (context {self._max_context}, one token "
                f"left to generate)"
            )

    def prefill_insert(self, slot: int, prompt: list[int], sampling: Sampling, seed: int) -> int:
        """Start a sequence in `slot`; return its first generated token."""
        if not 0 <= slot < self._slots:
            raise ValueError(f"slot {slot} out of range [0, {self._slots})")
        self.check_prompt(prompt)
        token = self._run_prefill(slot, prompt, sampling, seed)
        self._active[slot] = True
        self._lengths[slot] = len(prompt) + 1
        return token

    def _run_prefill(self, slot: int, prompt: list[int], sampling: Sampling, seed: int) -> int:
        bucket = self.bucket_for(len(prompt))
        padded = np.zeros(bucket, np.int32)  # padded: [T]
        padded[: len(prompt)] = prompt
        params = SlotSampling(
            temperature=np.float32(max(0.0, sampling.temperature)),
            top_k=np.int32(sampling.top_k if sampling.top_k > 0 else 0),
            top_p=np.float32(sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0),
        )
        self._state, token = self._prefill_insert(
            self.params, self._state, padded, np.int32(len(prompt)), np.int32(slot), params,
            np.uint32(seed % 2**32),
        )  # fmt: skip
        return int(token)

    def _run_step(self, window: int):
        self._state, tokens = self._generate(self.params, self._state, window)
        return tokens

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
        """
        pending = PendingStep(self._run_step(self.window_for()))
        self._lengths[self._active] = np.minimum(
            self._lengths[self._active] + 1, self._max_context
        )
        return pending

    def free(self, slot: int) -> None:
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
