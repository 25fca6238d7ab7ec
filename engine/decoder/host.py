"""What both decoders (JAX `engine.decoder.DecoderEngine`, torch
`engine.torch_decoder.TorchDecoder`) decide alike on the host: the context capped to
what the model can attend to, its tokenizer and end tokens, and the prompt checks.
Functions, not a base class: each engine composes them into its own `DecoderInfo`.
"""

from __future__ import annotations

from pathlib import Path

from engine.decoder.config import DecoderConfig
from engine.interface import DecoderInfo
from engine.tokenizer import Tokenizer, has_tokenizer
from shared.logging import get_logger

log = get_logger(__name__)


def capped_context(cfg: DecoderConfig, requested: int) -> int:
    """`requested` tokens per slot, at most the model's positions (a sliding window
    is served by masking, not by capping the context at it)."""
    limit = cfg.max_positions
    if requested > limit:
        log.warning("max_context_capped", requested=requested, limit=limit)
    context = min(int(requested), limit)
    if context < 2:
        raise ValueError("max_context must be at least 2")
    return context


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's own tokenizer (tokenizer.json, or a GGUF file's vocabulary), or None."""
    return Tokenizer.from_dir(model_dir) if has_tokenizer(model_dir) else None


def describe(name: str, model_dir: str | Path, cfg: DecoderConfig, dtype: str, slots: int,
             max_context: int, devices: list[str], device: str,
             prefix_block: int = 0) -> DecoderInfo:
    """A decoder's `DecoderInfo`: its context capped, its tokenizer loaded, its end
    tokens the tokenizer's (else the config's)."""
    tokenizer = load_tokenizer(Path(model_dir))
    eos = (tuple(tokenizer.eos_token_ids) if tokenizer is not None and tokenizer.eos_token_ids
           else tuple(cfg.eos_token_ids))  # fmt: skip
    return DecoderInfo(name=name, device=device, devices=tuple(devices), dtype=dtype,
                       slots=int(slots), max_context=capped_context(cfg, max_context),
                       vocab_size=cfg.vocab_size, eos_token_ids=eos,
                       prefix_block=prefix_block, tokenizer=tokenizer)  # fmt: skip


def check_prompt(info: DecoderInfo, prompt: list[int]) -> None:
    """ValueError, with a message for the user, if `prompt` cannot be served."""
    if not prompt:
        raise ValueError("prompt is empty: at least one token is needed")
    if len(prompt) > info.max_context - 1:
        raise ValueError(
            f"prompt has {len(prompt)} tokens; {info.name} accepts at most "
            f"{info.max_context - 1} (context {info.max_context}, one token "
            f"left to generate)"
        )


def check_slot(info: DecoderInfo, slot: int) -> None:
    if not 0 <= slot < info.slots:
        raise ValueError(f"slot {slot} out of range [0, {info.slots})")
