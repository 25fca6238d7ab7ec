"""Whole-prompt and lock-step generation over any `engine.interface.Decoder`: what
tests and benchmarks drive an engine with. The worker never does either: it admits,
chunks, preempts and steps sequences itself (services/worker/generation.py)."""

from __future__ import annotations

import numpy as np

from engine.interface import Decoder
from shared.messages import Sampling

GREEDY = Sampling(temperature=0.0)


def prefill_insert(engine: Decoder, slot: int, prompt: list[int], sampling: Sampling,
                   seed: int) -> int:
    """Start a sequence in `slot`, its whole prompt at once; return its first token."""
    if not engine.begin(slot, prompt, sampling, seed):
        raise RuntimeError(f"the cache has no room for a prompt of {len(prompt)} tokens now")
    while (token := engine.prefill_step(slot)) is None:
        pass
    return token


def newest(holders: list[int]) -> int:
    """A preemption policy: the sequence that began last gives its cache back."""
    return holders[-1]


def no_preemption(holders: list[int]) -> int:
    raise RuntimeError("the cache is too small for every live sequence's next token")


def step(engine: Decoder, victim=no_preemption) -> np.ndarray:
    """Make room (by `victim`'s policy), then one decode step, read -> [slots] int32."""
    engine.make_room(victim)
    pending = engine.step_async()
    if pending is None:
        raise RuntimeError("no slot is live")
    return pending.result()


def generate_static(engine: Decoder, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy, `max_new` tokens for each prompt, `slots` prompts at a time, all
    decoding in lock-step (a static batch: the engine's ceiling)."""
    out: list[list[int]] = []
    slots, context = engine.info.slots, engine.info.max_context
    for start in range(0, len(prompts), slots):
        group = prompts[start : start + slots]
        for p in group:
            if len(p) + max_new > context:
                raise ValueError(f"{len(p)} + {max_new} tokens exceed the context")
        seqs = [[prefill_insert(engine, i, p, GREEDY, 0)] for i, p in enumerate(group)]
        for _ in range(max_new - 1):
            tokens = step(engine)
            for i, seq in enumerate(seqs):
                seq.append(int(tokens[i]))
        for i in range(len(group)):
            engine.free(i)
        out.extend(seqs)
    return out
