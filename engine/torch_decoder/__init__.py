"""Decoder engine in eager torch: GPT-2 and Llama families, the second
implementation of `engine.interface.Decoder` (the JAX one is `engine.decoder`)."""

from engine.torch_decoder.engine import TorchDecoder

__all__ = ["TorchDecoder"]
