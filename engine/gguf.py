"""A GGUF file (llama.cpp's format) as a model directory: config, weights, tokenizer,
chat template, so the rest of the engine sees what a Hugging Face directory gives.

1. Config: `shared.gguf.hf_config` maps the `llama.*` / `qwen2.*` / `qwen3.*`
   metadata to config.json keys.
2. Weights: every tensor is dequantized with the `gguf` package (Q4_1, Q8_0, the
   K-quants Q4_K / Q5_K / Q6_K, ... to float32), renamed to the Hugging Face names,
   and in Llama files q_proj / k_proj get their rows un-permuted: llama.cpp's
   converter reorders each head's rows from the two-halves RoPE layout transformers
   uses to interleaved pairs; the inverse is transformers' own
   (`LlamaTensorProcessor._reverse_permute_weights`). A `rope_freqs` tensor is no
   weight: `shared.gguf.llama3_scaling` reads it into the config.
3. Tokenizer: the vocabulary, merges and token types (`tokenizer.ggml.*`) rebuilt
   as a `tokenizers` byte-level BPE with the pre-tokenizer llama.cpp applies for the
   file's `tokenizer.ggml.pre` (SmolLM's digits-first, GPT-2's, Llama 3's
   `llama-bpe`, Qwen2's), control tokens as special added tokens. A SentencePiece
   vocabulary (`tokenizer.ggml.model` = `llama`: Llama 2, Mistral, Gemma) becomes
   a BPE whose merges are every split of a token into two tokens, best score first
   (SentencePiece's own rule), with byte fallback (`gguf_spm.py`).
4. Chat template: `tokenizer.chat_template`, with the special tokens' text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from shared.gguf import GGUFError, Header, hf_config, read_header

if TYPE_CHECKING:  # numpy only where tensors are read: the gateway's tokenizer path has none
    import numpy as np

# GGUF tensor name -> Hugging Face name (Llama layout); layer tensors are `blk.N.<name>`.
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# llama.cpp's converter reorders q/k rows for the RoPE it applies to Llama files only;
# Qwen files keep transformers' order (llama.cpp rotates them the NeoX way).
_PERMUTED = ("llama",)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order. w: [heads * D, ...] with each head's rows as
    (D/2 pairs, 2) -> (2 halves, D/2), the order the rotate-half RoPE expects."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_data(path: str | Path, header: Header):
    """(name, ggml type, data) per tensor: views of one memory map of the file, laid
    out as `gguf.quants.dequantize` takes them (F32 / F16 typed in [out, in] order,
    every other type as rows of bytes). From shared/gguf.py's header: the gguf
    package's reader builds every metadata field first (the whole vocabulary), seconds
    of a cold start."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    align = int(header.metadata.get("general.alignment", 32))
    start = -(-header.size // align) * align  # the data section, aligned
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, (shape, kind) in header.tensors.items():
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has an unknown type {kind}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        at, n = start + header.offsets[name], int(np.prod(shape)) * size // block
        raw = mm[at : at + n]
        if len(raw) != n:
            raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file")
        data: np.ndarray
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        yield name, qtype, data


def dequantize(data, qtype):
    """A tensor's stored bytes -> float32, as the gguf package's `dequantize` computes
    it, bit for bit: whole tensors at once for the block types engine/gguf_blocks.py
    reads (the package works 16 rows at a time: SmolLM2's engine build took 4.5 s
    with it and 3.3-3.6 s without); other types go to the package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    from engine.gguf_blocks import block_floats

    w = block_floats(data, GGMLQuantizationType(qtype).name)
    return reference(data, qtype) if w is None else w


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32, under Hugging Face names."""
    return _load(path, keep=False)


def load_blocks(path: str | Path) -> dict:
    """Every tensor of the file under Hugging Face names, as `load_weights` gives them,
    except that tensors of the block types engine/gguf_blocks.py holds (Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay as their blocks (`kept_blocks`): a model
    served as the file's blocks (quantization "gguf") skips expanding them to float32
    and rounding them back, most of a cold start's weight preparation (SmolLM2: 2.0
    s). q_proj and k_proj rows are un-permuted integers, scales and minimums alike."""
    return _load(path, keep=True)


def _load(path: str | Path, keep: bool) -> dict:
    import dataclasses

    import numpy as np
    from gguf import GGMLQuantizationType

    from engine.gguf_blocks import kept_blocks
    from engine.quant import QWeight

    header = read_header(path)
    cfg = hf_config(header)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = header.architecture in _PERMUTED
    out: dict = {}
    for gguf_name, qtype, data in _tensor_data(path, header):
        if gguf_name == "rope_freqs.weight":  # the config's rope_scaling (shared.gguf)
            continue
        name = hf_name(gguf_name)
        if name is None:
            raise GGUFError(f"{path}: tensor {gguf_name!r} has no Llama counterpart")
        kept = kept_blocks(data, GGMLQuantizationType(qtype).name) if keep else None
        # [out, in] (numpy order); copied out of the file's map
        w: QWeight | np.ndarray = (kept if kept is not None
                                   else np.array(dequantize(data, qtype), dtype=np.float32))
        part = gguf_name.split(".")[-2]  # weights and biases alike
        if permuted and part in heads:
            fix = lambda a: None if a is None else unpermute_rows(a, heads[part])  # noqa: E731
            w = (unpermute_rows(w, heads[part]) if isinstance(w, np.ndarray)
                 else dataclasses.replace(w, q=fix(w.q), scale=fix(w.scale), offset=fix(w.offset)))
        out[name] = w
    return out


def tensor_types(path: str | Path) -> dict[str, str]:
    """Hugging Face name -> the file's storage type of that tensor ("Q4_1", "Q8_0",
    "F32", ...), from the header alone (shared/gguf.py's parse, cached per file: the
    gguf package's reader builds every metadata field, the 49k-token vocabulary
    included, and took seconds of every start)."""
    from gguf import GGMLQuantizationType

    types = {hf_name(name): GGMLQuantizationType(kind).name
             for name, (_, kind) in read_header(path).tensors.items()}  # fmt: skip
    return {k: v for k, v in types.items() if k is not None}


# --- tokenizer

# `tokenizer.ggml.pre` values whose split llama.cpp (llama-vocab.cpp) does exactly as
# a tokenizers pipeline can: every number character on its own, then GPT-2's
# expression (SmolLM's own tokenizer.json: a Digits pre-tokenizer, then ByteLevel);
# or GPT-2's expression alone. Any other value is refused rather than guessed.
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
_GPT2 = {"gpt-2", "olmo", "mpt", "jais"}
# Values whose split is one regex ahead of a byte-level step without its own, as
# their tokenizer.json files declare it: Llama 3's (digits in runs of up to three)
# and Qwen2's (each digit apart).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT % "{1,3}", "llama3": _LLAMA3_SPLIT % "{1,3}",
           "qwen2": _LLAMA3_SPLIT % ""}  # fmt: skip
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> set[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return set(ByteLevel.alphabet())


def build_tokenizer(header: Header):
    """`tokenizers.Tokenizer` for the file's vocabulary (byte-level BPE or SentencePiece)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    m = header.metadata
    kind, pre = m.get("tokenizer.ggml.model"), m.get("tokenizer.ggml.pre", "(none)")
    if kind == "llama":
        from engine.gguf_spm import build_sentencepiece

        return build_sentencepiece(header)
    if kind != "gpt2":
        raise GGUFError(f"{header.path}: tokenizer model {kind!r} is not supported "
                        f"(gpt2 and llama are)")
    if pre not in _DIGITS_FIRST | _GPT2 | set(_SPLITS):
        raise GGUFError(f"{header.path}: pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = m["tokenizer.ggml.tokens"]
    types: list[int] = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(pair.split(" ", 1)) for pair in m.get("tokenizer.ggml.merges", ())]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet cannot be one the BPE emits
    # (a mislabel); it is left as a plain vocabulary entry, as transformers does.
    alphabet = _byte_alphabet()
    tok.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types) if kind == _USER_DEFINED
    ])  # fmt: skip
    return tok


def special_ids(header: Header) -> dict[str, int | None]:
    m = header.metadata
    keys = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
    return {key: m.get(f"tokenizer.ggml.{key}") for key in keys}


def special_tokens(header: Header) -> dict[str, str]:
    """bos/eos/pad/unk token text, the variables a chat template may use."""
    tokens = header.metadata.get("tokenizer.ggml.tokens") or []
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}  # fmt: skip
    ids, out = special_ids(header), {}
    for name, key in names.items():
        i = ids[key]
        if i is not None and 0 <= i < len(tokens):
            out[name] = tokens[i]
    return out


def chat_template(header: Header) -> str | None:
    value = header.metadata.get("tokenizer.chat_template")
    return value if isinstance(value, str) else None
