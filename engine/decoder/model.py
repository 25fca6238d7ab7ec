"""Forward passes shared by both families, over a per-family module of four parts.

A family module (gpt2, llama) provides `load_params`, `embed`, `attn_in` (norm, qkv,
positions), `attn_out` (output projection, MLP, residuals) and `head`. This module
owns the layer loop and where keys and values go:

- `forward_prompt`: a whole (padded) prompt, causal attention, returns its K/V.
- `forward_chunk`: a piece of one prompt from an offset, its K/V written into the
  sequence's blocks, attending to the blocks before it (prefill, prefix reuse, chunks).
- `decode_forward`: one token per slot against the paged cache, written in place at
  each slot's own position, read through each slot's block table.
- `forward_packed`: tokens of several sequences in one pass (decode rows and prompt
  chunks side by side, a mixed step), each at its own position through its own
  table; the CPU kernel only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.decoder import gpt2, llama
from engine.decoder.config import GPT2, LLAMA, DecoderConfig
from engine.decoder.blocks import SCRATCH
from engine.decoder.attention import (chunk_attention, gather, packed_attention, paged_decode,
                                      write)
from engine.decoder.layers import causal_attention, context_attention, inv_frequencies, rope_scale

FAMILIES = {GPT2: gpt2, LLAMA: llama}
_PREFIXES = {GPT2: ("transformer.",), LLAMA: ("model.",)}


def family(cfg: DecoderConfig):
    return FAMILIES[cfg.family]


def load_params(
    model_dir: str | Path, cfg: DecoderConfig, dtype, quant: str = "none", mesh=None
) -> dict:
    """Weights of a Hugging Face directory -> parameter pytree of device arrays.

    `quant` (int8 | int4 | fp8) stores the matmul weights and the embedding as
    `engine.quant.QWeight`; `mesh` (tensor parallelism, `cfg.tensor_parallel`
    devices) places them split by head and MLP column (engine/sharding.py)."""
    form = "float" if quant == "none" else "dequant"
    return load_param_forms(model_dir, cfg, dtype, quant, (form,), mesh)[form]


def load_param_forms(
    model_dir: str | Path, cfg: DecoderConfig, dtype, quant: str, forms, mesh=None,
    cache: Path | None = None,
) -> dict[str, dict]:
    """One parameter pytree per compute form (engine/forms.py), from one read of the
    weights: "dequant" (the stored `quant` weights), "float" (those dequantized, or
    the float weights when `quant` is none), "w8a8" (int8 per output channel).
    `cache`: a folder of prepared weights (engine/prepared.py) the host trees are
    read from, or written to when they are built."""
    from engine import quant as q
    from engine import sharding

    host, _ = load_host_forms(model_dir, cfg, quant, forms, cache)
    out = {}
    if quant == "none":
        out["float"] = q.cast_tree(host["float"], dtype)
    elif "dequant" in host:
        out["dequant"] = q.cast_tree(host["dequant"], dtype)
        if "float" in forms:
            out["float"] = q.dequantize_tree(out["dequant"], dtype)
    if "w8a8" in host:
        out["w8a8"] = q.cast_tree(host["w8a8"], dtype)
    out = {f: t for f, t in out.items() if f in forms}
    return out if mesh is None else {f: sharding.place(t, mesh) for f, t in out.items()}


def load_host_forms(model_dir: str | Path, cfg: DecoderConfig, quant: str, forms,
                    cache: Path | None = None) -> tuple[dict[str, dict], str]:
    """The host (numpy) trees `load_param_forms` casts and places, keyed "float"
    (quant none), "dequant" and "w8a8"; and how they came: "cache", "built" (and
    kept in `cache`) or "built, not kept" (engine/prepared.py)."""
    from engine import prepared
    from engine.weights import weight_files

    hosts = {"float"} if quant == "none" else set()
    if quant != "none" and ("dequant" in forms or "float" in forms):
        hosts.add("dequant")
    if quant != "none" and "w8a8" in forms:
        hosts.add("w8a8")
    fields = {"config": dataclasses.asdict(cfg), "quant": quant, "forms": sorted(hosts)}
    sources = weight_files(model_dir)
    config = Path(model_dir) / "config.json"
    if config.exists():  # its quantization_config says how stored weights read (prequant)
        sources = [*sources, config]
    return prepared.load_or_build(cache, sources, fields,
                                  lambda: _build_host_forms(model_dir, cfg, quant, hosts))


def _build_host_forms(model_dir: str | Path, cfg: DecoderConfig, quant: str,
                      hosts: set[str]) -> dict[str, dict]:
    from engine import quant as q
    from engine import sharding
    from engine.weights import load_weights, strip_prefix

    fam = family(cfg)
    blocks = quant == "gguf" and hosts == {"dequant"} and cfg.tensor_parallel == 1
    if blocks:  # the file's blocks as they are: checked first (gguf_blocks refuses)
        how: str | dict[str, tuple[str, int]] = gguf_blocks(model_dir, cfg)
        weights = strip_prefix(_file_blocks(model_dir), _PREFIXES[cfg.family])
    else:
        weights = strip_prefix(load_weights(model_dir), _PREFIXES[cfg.family])
    tree = fam.load_params(weights, cfg)
    del weights  # the tree holds transposed copies: one host copy fewer at the peak
    if cfg.tensor_parallel > 1:
        for lp in tree["layers"]:
            for name, parts in fam.fused(cfg).items():
                if name in lp:
                    lp[name] = sharding.shard_major(lp[name], parts, cfg.tensor_parallel)
    out = {}
    if "float" in hosts:
        out["float"] = tree
    if "dequant" in hosts:
        how = how if blocks else gguf_blocks(model_dir, cfg) if quant == "gguf" else quant
        out["dequant"] = q.quantize_tree(tree, how, fam.QUANT_AXES)  # kept blocks stay
    if "w8a8" in hosts:
        out["w8a8"] = q.quantize_tree(_fold_mlp_norm(tree, cfg), "w8a8", fam.QUANT_AXES)
    return out


def _file_blocks(model_dir: str | Path) -> dict:
    """A GGUF model's tensors with its blocks kept (engine/gguf_blocks.py)."""
    from engine import gguf
    from shared.gguf import find_file

    path = find_file(Path(model_dir))
    assert path is not None  # gguf_blocks, called first, refuses a model without one
    return gguf.load_blocks(path)


# Tree weight -> the Hugging Face tensors it is made of (layer 0 stands for all).
_SOURCES = {
    "embed": ("model.embed_tokens.weight",), "lm_head": ("lm_head.weight",),
    "qkv_w": tuple(f"model.layers.{{i}}.self_attn.{n}_proj.weight" for n in "qkv"),
    "o_w": ("model.layers.{i}.self_attn.o_proj.weight",),
    "gate_up_w": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "down_w": ("model.layers.{i}.mlp.down_proj.weight",),
}  # fmt: skip
_FLOAT = {"F32", "F16", "BF16"}


def gguf_blocks(model_dir: str | Path, cfg: DecoderConfig) -> dict[str, tuple[str, int]]:
    """quant "gguf": for each quantized weight of the tree, the (mode, group) whose
    layout holds the file's blocks (engine/gguf_blocks.py; the widest where a weight's
    tensors differ, as a Q4_K_M file's Q6_K v_proj beside its Q4_K q_proj). Where the
    blocks are read as they are (one device), they are kept exactly; where they cannot
    be (several devices), the weights are requantized to that form from the file's
    dequantized values: Q8_0 and Q4_1 give back their integers (within float32
    rounding), the others are rounded once more. ValueError for a model that is not
    one GGUF file, or a block type with no such form (Q2_K, Q3_K, the IQ types)."""
    from engine import gguf
    from engine.gguf_blocks import BLOCK_TYPES
    from shared.gguf import find_file

    path = find_file(Path(model_dir)) if Path(model_dir).is_dir() else None
    if path is None or cfg.family != LLAMA:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks; {model_dir} has none")
    types = gguf.tensor_types(path)
    out = {}
    for leaf, names in _SOURCES.items():
        found = {types[n.format(i=i)] for n in names for i in range(cfg.layers)
                 if n.format(i=i) in types}  # fmt: skip
        if not found or found <= _FLOAT:
            continue
        if not found <= set(BLOCK_TYPES):
            raise ValueError(f"quantization 'gguf' keeps {', '.join(BLOCK_TYPES)} blocks; "
                             f"{leaf} is stored as {', '.join(sorted(found))}: use int8 or "
                             f"int4")  # fmt: skip
        forms = [BLOCK_TYPES[t] for t in found]
        mode = "int8" if any(m == "int8" for m, _ in forms) else "int4"
        out[leaf] = (mode, min(g for _, g in forms))
    return out


def _fold_mlp_norm(tree: dict, cfg: DecoderConfig) -> dict:
    """Llama, for int8 activations: the MLP's RMSNorm weight moved into the rows of
    gate_up (the same function in exact arithmetic). That weight scales a few input
    channels far above the rest, and a row's int8 scale follows its largest entry:
    folded, SmolLM2's perplexity with int8 activations went from +4.5 % to +1.5 % of
    float32 (folding the attention norm the same way made it worse: +6.9 %)."""
    if cfg.family != LLAMA:
        return tree
    layers = []
    for lp in tree["layers"]:
        lp = dict(lp)
        lp["gate_up_w"] = lp["ln2_w"].astype(np.float32)[:, None] * lp["gate_up_w"]
        lp["ln2_w"] = np.ones_like(lp["ln2_w"])
        layers.append(lp)
    return dict(tree, layers=layers)


def _inv_freqs(cfg: DecoderConfig, seq_len) -> list:
    """Each layer's RoPE (frequencies, cos/sin scale); (None, 1.0) for GPT-2. Gemma 3's
    sliding layers have their own base. `seq_len`: [] or [N] int32, the length of the
    sequence each row's keys belong to when it is computed: longrope takes its long
    factors past the pre-training length, as transformers decides per forward."""
    if cfg.family != LLAMA:
        return [(None, 1.0)] * cfg.layers
    glob = jnp.asarray(inv_frequencies(cfg))
    if cfg.rope_scaling[0] == "longrope":
        long = jnp.asarray(inv_frequencies(cfg, long=True))
        glob = jnp.where((jnp.asarray(seq_len) > cfg.rope_scaling[3])[..., None], long, glob)
    if cfg.local_rope_theta is None:
        return [(glob, rope_scale(cfg))] * cfg.layers
    local = (jnp.asarray(inv_frequencies(cfg, local=True)), rope_scale(cfg, local=True))
    return [local if cfg.window(i) is not None else (glob, rope_scale(cfg))
            for i in range(cfg.layers)]


def forward_prompt(params: dict, cfg: DecoderConfig, tokens, length=None):
    """tokens: [T] -> x: [T, E] (before the final norm), k, v: L x [KV, T, D]

    Without a cache: the reference path the tests check logits on. Padding after the true length cannot reach earlier positions (causal mask), so
    the caller reads hidden states and K/V only below the true length, given as
    `length` ([] int32; None: all of `tokens`) where longrope needs it.
    """
    fam = family(cfg)
    inv_freqs = _inv_freqs(cfg, tokens.shape[0] if length is None else length)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = fam.embed(params, cfg, tokens, positions)
    ks, vs = [], []
    for i, lp in enumerate(params["layers"]):
        q, k, v = fam.attn_in(lp, cfg, x, positions, *inv_freqs[i])
        x = fam.attn_out(lp, cfg, x, causal_attention(q, k, v, cfg, cfg.window(i)))
        ks.append(k.swapaxes(0, 1))  # [KV, T, D]
        vs.append(v.swapaxes(0, 1))
    return x, tuple(ks), tuple(vs)


def prompt_logits(params: dict, cfg: DecoderConfig, tokens, length=None):
    """tokens: [T] -> logits: [T, V] float32 at every position."""
    x, _, _ = forward_prompt(params, cfg, tokens, length)
    return family(cfg).head(params, cfg, x)


def token_nll(params: dict, cfg: DecoderConfig, tokens):
    """tokens: [T] -> [T - 1] float32: -log p(tokens[i + 1] | tokens[: i + 1]), the
    terms of a perplexity (padding past the true length: ignore those entries)."""
    logp = jax.nn.log_softmax(prompt_logits(params, cfg, tokens)[:-1], axis=-1)  # [T-1, V]
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]


def last_logits(params: dict, cfg: DecoderConfig, x, true_length):
    """x: [T, E] -> logits: [V] float32 of the last true token only (the lm head is
    the largest matmul of a small model: run it on one row, not T)."""
    row = jax.lax.dynamic_slice_in_dim(x, true_length - 1, 1, axis=0)  # [1, E]
    return family(cfg).head(params, cfg, row)[0]


def decode_forward(params: dict, cfg: DecoderConfig, tokens, positions, tables, live,
                   k_cache, v_cache, kernel: str = "xla", interpret: bool = False):
    """One step for a batch of rows, over the paged cache.

    tokens, positions: [S] int32; tables: [S, NW] int32 (each row's first NW blocks);
    live: [S] bool; k_cache, v_cache: L x [KV, NB, BLOCK, D]; kernel: the paged
    attention's implementation (engine/decoder/attention.py)
    -> logits: [S, V] float32, and both caches with each live row's new K/V written at
    its position. A row that is not live writes into the scratch block, never into a
    block its stale table may still name (that block may belong to someone else now).

    NW (static, from the table's shape) is the attention window in blocks: reading the
    cache is most of a step's cost, and live sequences are usually short. Every live
    slot must have its position below NW * BLOCK.
    """
    fam, inv_freqs = family(cfg), _inv_freqs(cfg, positions + 1)
    block, nw = k_cache[0].shape[2], tables.shape[1]
    at = jnp.minimum(positions // block, nw - 1)
    blocks = jnp.where(live, jnp.take_along_axis(tables, at[:, None], 1)[:, 0], SCRATCH)  # [S]
    offsets = positions % block  # [S]
    x = fam.embed(params, cfg, tokens, positions)
    new_k, new_v = [], []
    for i, (lp, kc, vc) in enumerate(zip(params["layers"], k_cache, v_cache)):
        q, k, v = fam.attn_in(lp, cfg, x, positions, *inv_freqs[i])  # k, v: [S, KV, D]
        kc, vc = write(kc, blocks, offsets, k), write(vc, blocks, offsets, v)
        att = paged_decode(q, kc, vc, tables, positions, cfg, kernel, interpret, cfg.window(i))
        x = fam.attn_out(lp, cfg, x, att)
        new_k.append(kc)
        new_v.append(vc)
    return fam.head(params, cfg, x), tuple(new_k), tuple(new_v)


def forward_chunk(params: dict, cfg: DecoderConfig, tokens, offset, length, table,
                  k_cache, v_cache, kernel: str = "xla"):
    """A piece of one prompt, written into its blocks, attending to everything before.

    tokens: [T] int32 (padded), offset: [] int32 (tokens of this sequence already in
    the cache: a reused prefix, earlier chunks), length: [] int32 (true tokens in this
    chunk), table: [NC] int32 (the sequence's first NC blocks, NC * BLOCK >= offset +
    length), k_cache, v_cache: L x [KV, NB, BLOCK, D]; kernel: "cpu" reads the blocks
    in place (engine/decoder/attention.py), anything else gathers the table's window
    -> x: [T, E] (before the final norm), and both caches. Padding writes go to the
    scratch block; its queries are computed and ignored.
    """
    fam, inv_freqs = family(cfg), _inv_freqs(cfg, offset + length)
    block, nc = k_cache[0].shape[2], table.shape[0]
    positions = offset + jnp.arange(tokens.shape[0], dtype=jnp.int32)  # [T]
    real = jnp.arange(tokens.shape[0]) < length
    blocks = jnp.where(real, table[jnp.minimum(positions // block, nc - 1)], SCRATCH)  # [T]
    offsets = positions % block
    x = fam.embed(params, cfg, tokens, positions)
    new_k, new_v = [], []
    for i, (lp, kc, vc) in enumerate(zip(params["layers"], k_cache, v_cache)):
        q, k, v = fam.attn_in(lp, cfg, x, positions, *inv_freqs[i])  # k, v: [T, KV, D]
        kc, vc = write(kc, blocks, offsets, k), write(vc, blocks, offsets, v)
        if kernel == "cpu":  # padding queries (position -1) read nothing
            seen = jnp.where(real, positions, -1)
            att = chunk_attention(q, kc, vc, table, seen, cfg, cfg.window(i))
        else:
            kw, vw = gather(kc, table), gather(vc, table)  # [KV, NC * BLOCK, D]
            att = context_attention(q, kw, vw, positions, cfg, cfg.window(i))
        x = fam.attn_out(lp, cfg, x, att)
        new_k.append(kc)
        new_v.append(vc)
    return x, tuple(new_k), tuple(new_v)


def forward_packed(params: dict, cfg: DecoderConfig, tokens, rows, positions, lengths, tables,
                   k_cache, v_cache):
    """Tokens of several sequences in one pass, read and written in place ("cpu").

    tokens, rows, positions, lengths: [T] int32: each token, its table row, its
    position (-1: padding, written to the scratch block and attending to nothing)
    and the length of its sequence as this pass leaves it (longrope's choice, as
    `decode_forward` and `forward_chunk` make it); tables: [R, NW] int32
    -> x: [T, E] (before the final norm), and both caches."""
    fam, inv_freqs = family(cfg), _inv_freqs(cfg, lengths)
    block, nw = k_cache[0].shape[2], tables.shape[1]
    real = positions >= 0
    at = jnp.maximum(positions, 0)
    blocks = jnp.where(real, tables[rows, jnp.minimum(at // block, nw - 1)], SCRATCH)  # [T]
    offsets = at % block
    x = fam.embed(params, cfg, tokens, at)
    new_k, new_v = [], []
    for i, (lp, kc, vc) in enumerate(zip(params["layers"], k_cache, v_cache)):
        q, k, v = fam.attn_in(lp, cfg, x, at, *inv_freqs[i])  # k, v: [T, KV, D]
        kc, vc = write(kc, blocks, offsets, k), write(vc, blocks, offsets, v)
        att = packed_attention(q, kc, vc, tables, rows, positions, cfg, cfg.window(i))
        x = fam.attn_out(lp, cfg, x, att)
        new_k.append(kc)
        new_v.append(vc)
    return x, tuple(new_k), tuple(new_v)


def param_bytes(params: dict) -> int:
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params)))
