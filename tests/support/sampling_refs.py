"""Independent references for the sampling controls: transformers' repetition
penalty, OpenAI's documented presence/frequency formula, and greedy decoding under
them on transformers' own logits."""

from __future__ import annotations

import numpy as np
import torch

from shared.messages import Sampling


def hf_repetition(logits: np.ndarray, ids: list[int], penalty: float) -> np.ndarray:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    out = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), torch.tensor(logits[None]))
    return out[0].numpy()


def openai_penalties(logits: np.ndarray, generated: list[int], presence: float, frequency: float):
    counts = np.bincount(generated, minlength=len(logits)).astype(np.float32)
    return logits - presence * (counts > 0) - frequency * counts


def reference_greedy(model, prompt, n, sampling: Sampling) -> list[int]:
    """Greedy tokens with the controls applied to transformers' logits by the
    references above, one forward pass per token."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        for t, b in sampling.logit_bias:
            logits[t] += b
        if sampling.repetition_penalty != 1.0:
            logits = hf_repetition(logits, ids, sampling.repetition_penalty)
        logits = openai_penalties(logits, out, sampling.presence_penalty,
                                  sampling.frequency_penalty)
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out
