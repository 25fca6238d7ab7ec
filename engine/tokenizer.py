"""Text <-> token ids over a Hugging Face `tokenizer.json` (the `tokenizers` library).

The gateway tokenizes so that workers spend no time on it; this module is therefore
light: no jax, no torch, no numpy. It works for BERT WordPiece files as well as GPT-2
byte-level BPE and Llama-style files; chat templates and streaming detokenisation are
built on top of it elsewhere. A GGUF file's vocabulary is rebuilt as the same kind of
`tokenizers.Tokenizer` (engine/gguf.py; that path reads the file's header only).

Padding and truncation configured in the file are switched off: the engine pads to its
own shape buckets, and the caller must see the true length of an over-long input so it
can reject it with a clear error instead of silently embedding a prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

# Files that may name special tokens, most specific first.
_TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_MODEL_CONFIGS = ("generation_config.json", "config.json")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` in config files is an int, a list of ints, or null."""
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _gguf_file(d: Path) -> Path | None:
    from shared.gguf import find_file

    return find_file(d)


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether `Tokenizer.from_dir` finds a vocabulary in this directory."""
    d = Path(model_dir)
    return (d / "tokenizer.json").exists() or _gguf_file(d) is not None


class Tokenizer:
    """A thin, fast wrapper: batches of strings in, lists of ids out."""

    def __init__(
        self,
        tok: _HFTokenizer,
        *,
        pad_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        # encode_batch_fast skips offset tracking; older tokenizers lack it.
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self._cut: dict[int, Any] = {}  # max_length -> a truncating copy's encoder
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_id = pad_id if pad_id is not None else (eos_token_ids or (0,))[0]

    # --- construction

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls.from_dir(Path(path).parent, filename=Path(path).name)

    @classmethod
    def from_dir(cls, path: str | Path, filename: str = "tokenizer.json") -> "Tokenizer":
        """Load `tokenizer.json` and the special tokens named by the files beside it;
        a directory with a GGUF file and no tokenizer.json: the file's vocabulary."""
        d = Path(path)
        if not (d / filename).exists():
            gguf_file = _gguf_file(d)
            if gguf_file is not None:
                return cls.from_gguf(gguf_file)
        tok = _HFTokenizer.from_file(str(d / filename))
        padding = tok.padding  # read before __init__ switches it off
        tcfg = _read_json(d / _TOKENIZER_CONFIG)
        smap = _read_json(d / _SPECIAL_TOKENS_MAP)
        mcfgs = [_read_json(d / name) for name in _MODEL_CONFIGS]

        def named(key: str) -> int | None:
            for source in (tcfg, smap):
                text = _token_text(source.get(key))
                if text is not None and tok.token_to_id(text) is not None:
                    return tok.token_to_id(text)
            return None

        def configured(key: str) -> tuple[int, ...]:
            for cfg in mcfgs:
                ids = _as_ids(cfg.get(key))
                if ids:
                    return ids
            return ()

        eos = configured("eos_token_id")
        named_eos = named("eos_token")
        if named_eos is not None:  # the named one first: it is the primary eos
            eos = (named_eos, *(i for i in eos if i != named_eos))
        bos = named("bos_token")
        if bos is None:
            bos = (configured("bos_token_id") or (None,))[0]
        pad = named("pad_token")
        if pad is None:
            pad = (configured("pad_token_id") or (None,))[0]
        if pad is None and padding is not None:
            pad = padding.get("pad_id")
        return cls(tok, pad_id=pad, bos_token_id=bos, eos_token_ids=eos)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The vocabulary, merges and special tokens in a GGUF file's metadata."""
        from engine.gguf import build_tokenizer, special_ids
        from shared.gguf import read_header

        header = read_header(path)
        ids = special_ids(header)
        eos = ids["eos_token_id"]
        return cls(build_tokenizer(header), pad_id=ids["padding_token_id"],
                   bos_token_id=ids["bos_token_id"], eos_token_ids=() if eos is None else (eos,))

    # --- the hot path

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids per text, special tokens included, never truncated."""
        if not texts:
            return []
        encodings = self._encode(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_pairs(self, pairs: list[tuple[str, str]], max_length: int | None = None
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """Text pairs as a cross-encoder reads them, through the file's pair template
        (`[CLS] a [SEP] b [SEP]`, `<s> a </s></s> b </s>`): (ids, token type ids).
        With `max_length`, a longer pair is cut to it, special tokens included, the
        longer text first (the tokenizers library's `longest_first`, as transformers'
        `truncation=True` and TEI cut a pair)."""
        if not pairs:
            return [], []
        encode = self._encode if max_length is None else self._cutting(max_length)
        encodings = encode([tuple(p) for p in pairs], add_special_tokens=True)
        return [e.ids for e in encodings], [e.type_ids for e in encodings]

    def _cutting(self, max_length: int):
        """The batch encoder of a copy of the tokenizer that truncates at
        `max_length` (this one never does; a copy per length, made once)."""
        cut = self._cut.get(max_length)
        if cut is None:
            tok = _HFTokenizer.from_str(self._tok.to_str())
            tok.no_padding()
            tok.enable_truncation(max_length, strategy="longest_first", direction="right")
            cut = self._cut[max_length] = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return cut

    def count(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        return [len(ids) for ids in self.encode_batch(texts, add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, batch: list[list[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return self._tok.decode_batch(
            [list(ids) for ids in batch], skip_special_tokens=skip_special_tokens
        )

    # --- vocabulary

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def num_special_tokens_to_add(self) -> int:
        """How many ids `encode_batch` adds around one text (2 for BERT's CLS/SEP)."""
        return self._tok.num_special_tokens_to_add(False)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`, for code that needs its decoder."""
        return self._tok
