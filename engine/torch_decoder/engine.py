"""Host-side driver of the torch decoder engine: the same calls as the JAX
`engine.decoder.DecoderEngine` (`engine.interface.Decoder`), in eager torch.

Dataflow of a served sequence:
  1. `begin(slot, prompt, sampling, seed)` notes the request, then `prefill_step(slot)`
     runs `prefill_whole`: the prompt runs at its own
     length (eager torch has nothing to compile, so nothing is padded), its K/V go
     into positions [0, T) of `slot` in the preallocated cache, and the first token
     is drawn with the sequence's own generator, seeded from `seed`.
  2. `step()`: one decode step for the first N slots, N = one past the highest
     active slot (the worker fills the lowest free slot first, so N is the number of
     streams when slots are not fragmented); each writes its K/V in place at its own
     position and attends to the first `window` positions, window = the longest
     active sequence. A free slot inside [0, N) computes at position 0 of its own
     rows and its output is ignored.
  3. The caller ends a sequence (EOS, stop string, max tokens, `context_left(slot)
     == 0`) with `free(slot)`; the next insert overwrites the slot's rows.

Every call runs synchronously under `torch.inference_mode()`; `step_async()`
computes the step before it returns (a step thread that overlapped the caller's
host work measured slower when served: docs/decisions/0004). Threads:
`torch.set_num_threads` is left to the process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.decoder import host
from engine.decoder.config import load_config
from engine.decoder.static import GREEDY, prefill_insert
from engine.interface import CacheStats, DecoderStats, SpecStats, Victim
from engine.torch_decoder import model as M
from engine.torch_decoder.sampling import sample
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger(__name__)
# Sampling fields this engine does not implement, with the value that means "off".
UNSUPPORTED: tuple[tuple[str, object], ...] = (
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
    ("min_p", 0.0), ("logit_bias", []), ("logprobs", -1), ("grammar", ""), ("min_tokens", 0))


class DoneStep:
    """A step that has already run; `result()` is its tokens."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens  # [SLOTS] int32
        self.more: dict[int, list[int]] = {}  # no speculation: one token per slot

    def result(self) -> np.ndarray:
        return self._tokens


def _device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"


class TorchDecoder:
    """`engine.interface.Decoder` in eager torch, same constructor as `DecoderEngine`
    (its bucket and window arguments are accepted and unused: nothing compiles). A
    prompt is computed whole into a cache with a row per slot: nothing to chunk,
    share or preempt."""

    def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        raise ValueError("prompt logprobs ('echo' with 'logprobs', 'prompt_logprobs') "
                         "are computed by the JAX engine only: serve this model with "
                         "TENSORBUS_ENGINE=jax")

    def __init__(
        self,
        model_dir: str | Path,
        name: str,
        dtype: str = "float32",
        slots: int = 16,
        max_context: int = 512,
        prefill_buckets: tuple[int, ...] | None = None,
        decode_windows: tuple[int, ...] | None = None,
        device: str | None = None,
    ) -> None:
        del prefill_buckets, decode_windows
        t0 = time.perf_counter()
        if dtype not in M.TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(M.TORCH_DTYPES)}")
        self.name = name
        self.cfg = load_config(model_dir)
        self.device = _device(device)
        self.info = host.describe(name, model_dir, self.cfg, dtype, slots, max_context,
                                  [self.device], self.device)  # fmt: skip
        self.tokenizer = self.info.tokenizer
        self._slots, self._max_context = self.info.slots, self.info.max_context
        self._lengths = np.zeros(self._slots, np.int64)  # tokens in context per slot
        self._active = np.zeros(self._slots, bool)  # live: part of decode steps
        self._begun: dict[int, tuple[list[int], Sampling, int]] = {}  # slot -> its request
        tdt = M.TORCH_DTYPES[dtype]
        self.params = M.load_params(model_dir, self.cfg, tdt, self.device, self._max_context)
        shape = (self._slots, self.cfg.kv_heads, self._max_context, self.cfg.head_dim)
        with torch.inference_mode():
            # k, v: L x [S, KV, MAX_LEN, D], written in place by every call.
            zeros = lambda: torch.zeros(shape, dtype=tdt, device=self.device)  # noqa: E731
            self._k = [zeros() for _ in range(self.cfg.layers)]
            self._v = [zeros() for _ in range(self.cfg.layers)]
        self._tokens = np.zeros(self._slots, np.int64)  # the token each slot feeds next
        self._temperature = torch.zeros(self._slots, dtype=torch.float32, device=self.device)
        self._top_k = torch.zeros(self._slots, dtype=torch.int64, device=self.device)
        self._top_p = torch.ones(self._slots, dtype=torch.float32, device=self.device)
        self._generators: list[torch.Generator | None] = [None] * self._slots
        cache = 2 * self.cfg.layers * int(np.prod(shape)) * self._k[0].element_size()
        log.info(
            "decoder_loaded", model=name, engine="torch", family=self.cfg.family, dtype=dtype,
            device=self.device, slots=self._slots, max_context=self._max_context,
            param_bytes=self.params.nbytes, cache_bytes=cache,
            seconds=round(time.perf_counter() - t0, 3),
        )  # fmt: skip

    # ------------------------------------------------------------- properties
    @property
    def slots(self) -> int:
        return self._slots

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def kv_usage(self) -> float:
        """Fraction of the cache's positions held by active sequences."""
        used = int(self._lengths[self._active].sum())
        return used / (self._slots * self._max_context)

    def stats(self, prefixes: int = 0) -> DecoderStats:
        """Rows held of the per-slot cache; nothing compiled, cached or speculated."""
        held = round(self.kv_usage * self._slots)
        return DecoderStats(active=int(self._active.sum()),
                            cache=CacheStats(self._slots, held, 0, 0, 0, 0), spec=SpecStats())

    def context_left(self, slot: int) -> int:
        return int(self._max_context - self._lengths[slot])

    def token_logprobs(self, slot: int) -> None:
        return None  # check refuses requests that ask for logprobs

    def tune(self, limit: int = 1) -> int:
        return 0  # one compute form

    def on_compiled(self, callback) -> None:
        pass  # nothing compiles

    def close(self, wait_s: float = 0.0) -> bool:
        return True  # nothing compiles in the background

    # ----------------------------------------------------------------- warmup
    def warmup(self, progress: bool = True) -> int:
        """Run one prompt and one step (allocator and thread pool warm). Eager torch
        compiles nothing, so the count of compiled shapes is 0."""
        from tqdm import tqdm

        for _ in tqdm(range(1), desc=f"warm {self.name}", file=sys.stderr, disable=not progress):
            prefill_insert(self, 0, [0] * min(16, self._max_context - 1), GREEDY, 0)
            self.step()
            self.free(0)
        return 0

    # -------------------------------------------------------------- requests
    def check(self, prompt: list[int], sampling: Sampling | None = None) -> None:
        """The prompt must fit; this engine samples with temperature, top-k and top-p
        only: a request that asks for more is refused (a 400 naming the fields), never
        served without them."""
        host.check_prompt(self.info, prompt)
        if sampling is None:
            return
        asked = [name if name != "grammar" else "response_format (or tools)"
                 for name, off in UNSUPPORTED if getattr(sampling, name) != off]
        if asked:
            raise ValueError(f"{', '.join(asked)}: not supported by the torch engine "
                             f"serving {self.name}")

    def begin(self, slot: int, prompt: list[int], sampling: Sampling, seed: int,
              generated: int = 0) -> bool:
        host.check_slot(self.info, slot)
        self.check(prompt)
        self._begun[slot] = (list(prompt), sampling, seed)
        return True  # a row per slot: always room

    def prefilling(self, slot: int) -> int:
        job = self._begun.get(slot)
        return len(job[0]) if job else 0

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False) -> int | None:
        """The whole prompt, whatever the budget (nothing to chunk or mix)."""
        prompt, sampling, seed = self._begun.pop(slot)
        return self.prefill_whole(slot, prompt, sampling, seed)

    def make_room(self, victim: Victim) -> list[int]:
        return []  # every slot has its rows

    def step(self) -> np.ndarray:
        """One decode step, read (tests and benchmarks) -> [slots] int32."""
        return self._step().result()

    @torch.inference_mode()
    def prefill_whole(self, slot: int, prompt: list[int], sampling: Sampling, seed: int) -> int:
        """Start a sequence in `slot`; return its first generated token."""
        host.check_slot(self.info, slot)
        host.check_prompt(self.info, prompt)
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        self._temperature[slot] = max(0.0, sampling.temperature)
        self._top_k[slot] = sampling.top_k if sampling.top_k > 0 else 0
        self._top_p[slot] = sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0
        gen = None
        if sampling.temperature > 0:
            gen = torch.Generator().manual_seed(seed % 2**32)
        self._generators[slot] = gen
        tokens = torch.tensor(prompt, dtype=torch.int64, device=self.device)  # [T]
        x = M.prompt_forward(self.params, self.cfg, tokens, self._k, self._v, slot)  # [T, E]
        logits = M.head(self.params, self.cfg, x[-1:])  # [1, V]: the last row only
        at = slice(slot, slot + 1)
        token = int(sample(logits, self._temperature[at], self._top_k[at], self._top_p[at],
                           [gen])[0])  # fmt: skip
        self._tokens[slot] = token
        self._active[slot], self._lengths[slot] = True, len(prompt) + 1
        return token

    def step_async(self) -> DoneStep | None:
        """Run one decode step and return it done (see the module docstring for why it
        does not overlap the caller); a slot inserted after this call joins the next.
        None when no slot is live."""
        return self._step() if self._active.any() else None

    @torch.inference_mode()
    def _step(self) -> DoneStep:
        if not self._active.any():
            return DoneStep(self._tokens.astype(np.int32))
        n = int(np.flatnonzero(self._active)[-1]) + 1  # rows [0, n) run
        lengths = np.where(self._active[:n], self._lengths[:n], 1)
        positions = lengths - 1  # where each fed token's K/V goes; free rows: 0
        window = int(lengths.max())
        tokens = torch.from_numpy(self._tokens[:n]).to(self.device)  # [N]
        pos = torch.from_numpy(positions).to(self.device)  # [N]
        logits = M.decode_forward(self.params, self.cfg, tokens, pos, self._k, self._v, window)
        gens = [g if a else None for g, a in zip(self._generators[:n], self._active[:n])]
        drawn = sample(logits, self._temperature[:n], self._top_k[:n], self._top_p[:n], gens)
        self._tokens[:n] = np.where(self._active[:n], drawn.cpu().numpy(), 0)  # one host copy
        self._lengths[self._active] = np.minimum(self._lengths[self._active] + 1,
                                                 self._max_context)  # fmt: skip
        return DoneStep(self._tokens.astype(np.int32))

    def free(self, slot: int) -> None:
        self._active[slot], self._lengths[slot] = False, 0
        self._begun.pop(slot, None)
        self._tokens[slot] = 0
        self._generators[slot] = None
