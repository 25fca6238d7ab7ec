"""Inputs shared by the encoder and tokenizer tests: real sentences, and texts of an
exact token length for the long buckets (129..256 tokens crosses the tokenizer file's
own 128-token truncation, which must not apply)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from shared.catalog import ENCODER, bundled_dir

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome!",
    "Nuclear fusion powers the sun, turning hydrogen into helium.",
    "¿Dónde está la estación de tren?",
    "naïve café résumé — accents, dashes and “quotes”",
    "東京は日本の首都です。",
    "e-mail me at someone@example.com or call +1 (555) 010-2030",
    "hi",
    "",
]

# One WordPiece token each in MiniLM's uncased vocabulary.
_WORDS = ("river stone light garden music paper window table market summer "
          "forest bridge engine letter silver doctor").split()  # fmt: skip


def model_dir():
    return bundled_dir(ENCODER)


def words(n: int, offset: int = 0) -> str:
    """A text of n words that tokenizes to n + 2 ids ([CLS] ... [SEP])."""
    return " ".join(_WORDS[(i + offset) % len(_WORDS)] for i in range(n))


def mixed_texts(count: int = 40) -> list[str]:
    """Short sentences interleaved with long texts of 129..256 tokens."""
    long_lengths = [129, 256, 200, 150, 255, 131, 180, 240]
    out = []
    for i in range(count):
        if i % 4 == 3:
            out.append(words(long_lengths[(i // 4) % len(long_lengths)] - 2, i))
        elif i % 4 == 1:
            out.append(words(10 + 7 * i % 50, i))
        else:
            out.append(SENTENCES[i % len(SENTENCES)])
    return out
