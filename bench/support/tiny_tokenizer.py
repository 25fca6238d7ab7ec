"""A small byte-level BPE tokenizer (VOCAB entries, trained on two sentences) saved in
the Hugging Face layout beside a tiny model's weights: the tests' tiny decoders
(tests/support/tiny_models.py) and the family benchmark's (bench/family_load.py)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 320
TEXT = ["the quick brown fox jumps over the lazy dog", "a stream of tokens, one by one"]


def write_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
