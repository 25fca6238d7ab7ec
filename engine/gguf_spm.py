"""A SentencePiece vocabulary in a GGUF file (`tokenizer.ggml.model` = `llama`: Llama 2,
Mistral, Gemma) as a `tokenizers.Tokenizer`.

The file holds each piece, its score and its type (normal, unknown, control,
user-defined, unused, byte), no merges. SentencePiece's BPE (and llama.cpp's `llm_tokenizer_spm`)
merges, among adjacent pieces, the pair whose concatenation is a piece with the best
score. A `tokenizers` BPE does the same given every split of every piece into two
pieces as a merge, ranked by the whole piece's score (best first; ties: longer left
part first, as transformers' `generate_merges` orders them). Then:

- spaces become `▁`, with one prepended to the text unless
  `tokenizer.ggml.add_space_prefix` is false (Gemma);
- a character no piece covers falls back to its UTF-8 bytes as `<0xNN>` pieces;
- control pieces (`<s>`, `</s>`, `<unk>`) are special added tokens, user-defined
  ones plain added tokens, matched whole.

Gemma files list pieces in merge order while their scores do not follow it: their
rank is the position in the file, as transformers' GGUF loader takes it.
"""

from __future__ import annotations

from shared.gguf import GGUFError, Header

_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 2, 3, 4, 5, 6
_GEMMA = ("gemma", "gemma2", "gemma3")


def _merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    ranked = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]


def build_sentencepiece(header: Header):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    m = header.metadata
    tokens: list[str] = list(m["tokenizer.ggml.tokens"])
    types: list[int] = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = m.get("tokenizer.ggml.scores")
    if header.architecture in _GEMMA:
        # Runs of spaces are stored as spaces; the pieces the text becomes spell them ▁.
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    if scores is None:
        raise GGUFError(f"{header.path}: a SentencePiece vocabulary without scores")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    mergeable = [(t, s) for t, s, k in zip(tokens, scores, types)
                 if k not in (_CONTROL, _USER_DEFINED, _BYTE, _UNUSED)]
    merges = _merges([t for t, _ in mergeable], [s for _, s in mergeable], vocab)
    unk = next((t for t, k in zip(tokens, types) if k == _UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(m.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok
