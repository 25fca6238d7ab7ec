"""Hugging Face encoder weights -> the parameter pytree the encoder's forward
functions (engine/encoder/model.py) expect: one layout pass at load, none per call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine import jaxrt, sharding
from engine.encoder.config import BertConfig
from engine.encoder.spec import dense_weights
from engine.quant import cast_tree as quant_tree
from engine.quant import quantize_tree
from engine.sharding import shard_major
from engine.weights import COMMON_PREFIXES, load_weights, strip_prefix

Params = dict[str, Any]


# Contracted axis of each weight a quantized encoder stores as integers.
QUANT_AXES = {"qkv_w": 0, "o_w": 0, "i_w": 0, "f_w": 0, "word": 1}


def load_params(
    model_dir: str | Path, dtype: str = "float32", quant: str = "none", mesh=None
) -> Params:
    """HF BERT weights -> the pytree `forward` expects, on the default device (or
    split over `mesh`, engine/sharding.py).

    Done once at load so that the jitted step does no layout work: dense weights are
    transposed to [in, out]; Q, K and V are concatenated into one [D, 3D] matmul
    (shard-major when split: device i's columns are [q_i | k_i | v_i]); the position
    and (always zero) token-type embeddings are summed into one table, starting at
    the family's first position; MPNet's relative position bias table comes along
    ([buckets, H], float32). LayerNorm
    parameters stay float32; matmul weights take `dtype`, or `quant` (int8 | int4,
    engine/quant.py) for the dense weights and the word embeddings."""
    cfg = BertConfig(model_dir)
    if cfg.family == "decoder":
        return _decoder_params(model_dir, cfg, dtype, quant, mesh)
    w = strip_prefix(load_weights(model_dir), COMMON_PREFIXES + ("mpnet.",))
    if cfg.family == "modernbert":
        from engine.encoder import modernbert

        return modernbert.load_params(model_dir, cfg, w, dtype, quant, mesh)
    dt = jaxrt.parse_dtype(dtype)
    start = cfg.position_offset  # first position a token takes (RoBERTa: pad_id + 1)

    def f32(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float32)

    def dense(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        return f32(prefix + ".weight").T, f32(prefix + ".bias")  # [in, out], [out]

    layers = []
    tp = 1 if mesh is None else mesh.devices.size
    d = cfg.hidden
    names = cfg.names  # role -> the family's name for it (engine/encoder/config.py)
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        q, k, v = (dense(p + names[n]) for n in ("q", "k", "v"))
        wo, bo = dense(p + names["o"])
        wi, bi = dense(p + names["i"])
        wf, bf = dense(p + names["f"])
        layers.append({
            "qkv_w": shard_major(np.concatenate([q[0], k[0], v[0]], axis=1), (d, d, d), tp),  # [D, 3D]
            "qkv_b": shard_major(np.concatenate([q[1], k[1], v[1]]), (d, d, d), tp),  # [3D]
            "o_w": wo, "o_b": bo,  # [D, D], [D]
            "ln1_g": f32(p + names["ln1"] + ".weight"),
            "ln1_b": f32(p + names["ln1"] + ".bias"),
            "i_w": wi, "i_b": bi,  # [D, F], [F]
            "f_w": wf, "f_b": bf,  # [F, D], [D]
            "ln2_g": f32(p + names["ln2"] + ".weight"),
            "ln2_b": f32(p + names["ln2"] + ".bias"),
        })  # fmt: skip
    types = "embeddings.token_type_embeddings.weight"  # MPNet has none
    type0 = f32(types)[0] if types in w else np.zeros(d, np.float32)  # [D]
    tree = {
        "word": f32("embeddings.word_embeddings.weight"),  # [V, D]
        "pos": f32("embeddings.position_embeddings.weight")[start:] + type0,  # [P - start, D]
        "emb_ln_g": f32("embeddings.LayerNorm.weight"),
        "emb_ln_b": f32("embeddings.LayerNorm.bias"),
        "layers": layers,
        # sentence-transformers Dense layers after pooling: [IN, OUT], [OUT], [IN, OUT]?
        "head": [{"head_w": h["w"], "head_b": h["b"]} | ({} if h["r"] is None else {"head_r": h["r"]})
                 for h in dense_weights(model_dir, cfg.spec)],
    }
    if cfg.family == "mpnet":
        tree["rel_bias"] = f32("encoder.relative_attention_bias.weight")  # [NB, H]
    if cfg.spec.task == "score":
        tree["types"] = f32(types) - type0  # [T, D]
        tree["classifier"] = _classifier(w, cfg.family)
    keep_f32 = frozenset({"emb_ln_g", "emb_ln_b", "ln1_g", "ln1_b", "ln2_g", "ln2_b",
                          "head_w", "head_b", "head_r", "cls_w", "cls_b", "out_w", "out_b",
                          "rel_bias"})
    tree = quant_tree(quantize_tree(tree, quant, QUANT_AXES), dt, keep_f32)
    return tree if mesh is None else sharding.place(tree, mesh)


def _classifier(w, family: str) -> Params:
    """A *ForSequenceClassification head as two [in, out] matmuls: BERT's pooler
    then `classifier`; RoBERTa's `classifier.dense` then `classifier.out_proj`."""
    inner, outer = (("pooler.dense", "classifier") if family == "bert"
                    else ("classifier.dense", "classifier.out_proj"))  # fmt: skip

    def f32(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float32)

    return {"cls_w": f32(inner + ".weight").T, "cls_b": f32(inner + ".bias"),  # [D, D], [D]
            "out_w": f32(outer + ".weight").T, "out_b": f32(outer + ".bias")}  # [D, L], [L]


def _decoder_params(model_dir: str | Path, cfg: BertConfig, dtype: str, quant: str,
                    mesh) -> Params:
    """A decoder-based embedder: the decoder engine's parameter tree (its own loader:
    Llama-family names, fused projections) under "decoder", and the
    sentence-transformers Dense layers under "head" as any encoder's."""
    from engine.decoder.model import load_params as decoder_params
    from engine.encoder.spec import UnsupportedEncoder

    if quant != "none" or mesh is not None:
        raise UnsupportedEncoder("decoder-based embedders run with float weights on one "
                                 "device (no TENSORBUS_QUANT, no tensor parallelism)")
    head = [{"head_w": h["w"], "head_b": h["b"]} | ({} if h["r"] is None else {"head_r": h["r"]})
            for h in dense_weights(model_dir, cfg.spec)]
    return {"decoder": decoder_params(model_dir, cfg.decoder, jaxrt.parse_dtype(dtype)),
            "head": jax.tree.map(jnp.asarray, head)}
