"""Decoder engine: GPT-2 and Llama families in JAX, with a slot-based KV cache."""

from engine.decoder.engine import DecoderEngine

__all__ = ["DecoderEngine"]
