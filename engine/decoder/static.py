"""Whole-prompt and lock-step generation over any `engine.interface.Decoder`: what
tests and benchmarks drive an engine with. The worker never does either: it admits,
chunks and steps sequences itself (services/worker/generation.py)."""

from __future__ import annotations

from engine.interface import Decoder
from shared.messages import Sampling

GREEDY = Sampling(temperature=0.0)


def prefill_insert(engine: Decoder, slot: int, prompt: list[int], sampling: Sampling,
                   seed: int) -> int:
    """Start a sequence in `slot`, its whole prompt at once; return its first token."""
    engine.begin(slot, prompt, sampling, seed)
    while (token := engine.prefill_step(slot)) is None:
        pass
    return token


def generate_static(engine: Decoder, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy, `max_new` tokens for each prompt, `slots` prompts at a time, all
    decoding in lock-step (a static batch: the engine's ceiling)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), engine.slots):
        group = prompts[start : start + engine.slots]
        for p in group:
            if len(p) + max_new > engine.max_context:
                raise ValueError(f"{len(p)} + {max_new} tokens exceed the context")
        seqs = [[prefill_insert(engine, i, p, GREEDY, 0)] for i, p in enumerate(group)]
        for _ in range(max_new - 1):
            tokens = engine.step()
            for i, seq in enumerate(seqs):
                seq.append(int(tokens[i]))
        for i in range(len(group)):
            engine.free(i)
        out.extend(seqs)
    return out
