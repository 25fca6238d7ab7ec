"""How an encoder was trained to be used, read from its directory: the architecture
family, and sentence-transformers' modules after the transformer (pooling, dense
layers, normalisation) and its named prompts.

Pure Python (json only), so the worker, the registry's push and the torch engine
read it without jax. Everything the encoder engines cannot reproduce exactly is
refused here with `UnsupportedEncoder`, naming what and why; nothing is served with
a guessed pooling.

Read, in order:
  1. config.json: `model_type` picks the family (bert, roberta, xlm-roberta, mpnet,
     modernbert, or a decoder-based embedder);
     other encoder families are refused with the reason.
  2. modules.json: Transformer, then Pooling, Dense and Normalize modules in their
     order; any other module is refused. A directory without modules.json is what
     `SentenceTransformer(dir)` itself builds for it: mean pooling, no Normalize.
  3. each module's own config (1_Pooling/config.json, 2_Dense/config.json ...).
  4. config_sentence_transformers.json: prompts (name -> prefix text) and the
     default prompt name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Families whose math both encoder engines implement: post-LayerNorm BERT blocks,
# learned absolute positions. RoBERTa and XLM-RoBERTa number positions from
# padding_idx + 1 (fairseq's convention), BERT from 0; MPNet numbers them as RoBERTa
# and adds a bucketed relative position bias to every layer's attention scores.
# ModernBERT (pre-norm, rotary positions, alternating local attention, GeGLU) has its
# own forward in the JAX engine (engine/encoder/modernbert.py).
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "mpnet": "mpnet",
            "modernbert": "modernbert"}
# Decoder-based embedders (Qwen3-Embedding and the like): a causal decoder's last
# hidden states, pooled as the model's sentence-transformers modules say (last token),
# computed by the JAX encoder engine over the decoder engine's layers.
DECODER_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
SERVED = "bert, roberta, xlm-roberta, mpnet, modernbert; decoder-based: " + ", ".join(DECODER_FAMILIES)

# Encoder families seen in the wild that are not served, and why (the worker's
# exit-78 line and the push warning quote this).
REFUSED_FAMILIES = {
    "nomic-bert": "nomic-bert (rotary positions, SwiGLU) is not implemented by the encoder "
                  "engines; its modelling code lives only on the hub (trust_remote_code)",
    "distilbert": "DistilBERT's weight layout is not read by the encoder engines",
    "electra": "ELECTRA's embedding projection is not implemented by the encoder engines",
    "deberta": "DeBERTa's disentangled attention is not implemented by the encoder engines",
    "deberta-v2": "DeBERTa's disentangled attention is not implemented by the encoder "
                  "engines",
    "t5": "T5 encoders (relative attention buckets, RMSNorm) are not implemented by the "
          "encoder engines",
    "albert": "ALBERT's factorised, shared layers are not implemented by the encoder engines",
}  # fmt: skip

# Pooling modes, in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

# Dense activations (the torch.nn class name sentence-transformers stores) -> ours.
DENSE_ACTIVATIONS = {
    "Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu",
    "Sigmoid": "sigmoid", "SiLU": "silu",
}  # fmt: skip


# What a cross-encoder applies to its logits (sentence-transformers' CrossEncoder
# `activation_fn`, by torch class name) -> ours.
SCORE_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


class UnsupportedEncoder(ValueError):
    """The encoder engines cannot serve this model as it was trained to be used.
    The message names what (architecture, module, pooling) and why, in one line."""


@dataclass(frozen=True)
class DenseSpec:
    path: str  # folder holding the layer's weights, relative to the model directory
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a value of DENSE_ACTIVATIONS
    residual: bool


@dataclass(frozen=True)
class EncoderSpec:
    family: str  # "bert" | "roberta" (XLM-RoBERTa included) | "mpnet" | "modernbert" | "decoder"
    pooling: tuple[str, ...]  # POOLING_MODES, concatenated in this order
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)  # name -> prefix text
    default_prompt_name: str | None = None
    sentence_transformers: bool = True  # False: no modules.json, ST's own fallback
    # "embed": sentence embeddings; "score": a cross-encoder (reranker) whose
    # *ForSequenceClassification head turns the CLS state of a text pair into
    # `num_labels` logits, then `score_activation` (CrossEncoder.predict's default).
    task: str = "embed"
    num_labels: int = 0
    score_activation: str = "identity"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedEncoder(f"{path.name} in {path.parent} cannot be read: {exc}") from None


def family(cfg: dict) -> str:
    """config.json -> "bert" | "roberta" | "mpnet" | "modernbert" | "decoder" (a decoder-based
    embedder); UnsupportedEncoder for anything else."""
    model_type = str(cfg.get("model_type") or "").lower().replace("_", "-")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in DECODER_FAMILIES:
        return "decoder"
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedEncoder(f"architecture {model_type!r}: {REFUSED_FAMILIES[model_type]}; "
                                 f"served families: {SERVED}")  # fmt: skip
    archs = ", ".join(cfg.get("architectures") or []) or "none listed"
    raise UnsupportedEncoder(f"architecture {model_type or 'unknown'!r} ({archs}) is not an "
                             f"encoder family the encoder engines serve ({SERVED})")  # fmt: skip


def _pooling(cfg: dict, where: str) -> tuple[str, ...]:
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:  # sentence-transformers < 6: one boolean per mode; none set means mean
        modes = tuple(m for k, m in _LEGACY_POOLING_KEYS.items() if cfg.get(k))
        modes = modes or ("mean",)
    for m in modes:
        if m not in POOLING_MODES:
            raise UnsupportedEncoder(f"pooling {m!r} in {where} is not one of "
                                     f"{', '.join(POOLING_MODES)}")  # fmt: skip
    if not cfg.get("include_prompt", True):
        raise UnsupportedEncoder(f"pooling in {where} leaves the prompt's tokens out "
                                 f"(include_prompt: false); the encoder engines pool every "
                                 f"token")  # fmt: skip
    return modes


def _dense(cfg: dict, path: str) -> DenseSpec:
    act_path = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh")
    act = act_path.rsplit(".", 1)[-1]
    if act not in DENSE_ACTIVATIONS:
        raise UnsupportedEncoder(f"Dense layer {path}: activation {act_path!r} is not one of "
                                 f"{', '.join(DENSE_ACTIVATIONS)}")  # fmt: skip
    if cfg.get("module_input_name", "sentence_embedding") != "sentence_embedding" or \
            cfg.get("module_output_name", "sentence_embedding") != "sentence_embedding":
        raise UnsupportedEncoder(f"Dense layer {path} reads or writes something other than "
                                 f"the sentence embedding")  # fmt: skip
    return DenseSpec(path=path, in_features=int(cfg["in_features"]),
                     out_features=int(cfg["out_features"]), bias=bool(cfg.get("bias", True)),
                     activation=DENSE_ACTIVATIONS[act],
                     residual=bool(cfg.get("use_residual", False)))  # fmt: skip


def _modules(d: Path) -> tuple[tuple[str, ...], tuple[DenseSpec, ...], bool]:
    """modules.json -> (pooling modes, dense layers, normalize)."""
    entries = sorted(_read_json(d / "modules.json"), key=lambda e: int(e.get("idx", 0)))
    kinds = [str(e.get("type", "")).rsplit(".", 1)[-1] for e in entries]
    if not kinds or kinds[0] != "Transformer" or entries[0].get("path", "") not in ("", "."):
        raise UnsupportedEncoder(f"modules.json in {d} does not start with a Transformer "
                                 f"module at the model's root (found {kinds[:1]})")  # fmt: skip
    pooling: tuple[str, ...] | None = None
    dense: list[DenseSpec] = []
    normalize = False
    for entry, kind in zip(entries[1:], kinds[1:]):
        path = str(entry.get("path", ""))
        where = f"{path or '.'}/config.json"
        if normalize:
            raise UnsupportedEncoder(f"module {kind} after Normalize in modules.json is not served")
        if kind == "Pooling" and pooling is None and not dense:
            pooling = _pooling(_read_json(d / path / "config.json"), where)
        elif kind == "Dense" and pooling is not None:
            dense.append(_dense(_read_json(d / path / "config.json"), path))
        elif kind == "Normalize" and pooling is not None:
            normalize = True
        else:
            raise UnsupportedEncoder(f"sentence-transformers module {entry.get('type')!r} "
                                     f"({path or 'root'}) is not served: the encoder engines "
                                     f"run Transformer, Pooling, Dense and Normalize, in that "
                                     f"order")  # fmt: skip
    if pooling is None:
        raise UnsupportedEncoder(f"modules.json in {d} has no Pooling module: the model gives "
                                 f"token embeddings, not a sentence embedding")  # fmt: skip
    return pooling, tuple(dense), normalize


def read_prompts(d: Path) -> tuple[dict[str, str], str | None]:
    """config_sentence_transformers.json -> (prompt name -> prefix text, the default
    prompt's name or None). The gateway prepends them as it tokenizes."""
    path = d / "config_sentence_transformers.json"
    if not path.exists():
        return {}, None
    cfg = _read_json(path)
    prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedEncoder(f"default_prompt_name {default!r} in {path.name} names no "
                                 f"prompt (known: {', '.join(sorted(prompts)) or 'none'})")  # fmt: skip
    return prompts, default


def _cross_encoder(d: Path, cfg: dict, fam: str) -> EncoderSpec:
    """A *ForSequenceClassification directory: labels and the activation that
    sentence-transformers' CrossEncoder.predict applies (its own config, else the
    older places it kept it, else sigmoid for one label and none for several)."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UnsupportedEncoder(f"a CrossEncoder without a sequence-classification head "
                                 f"({', '.join(archs) or 'no architectures'})")  # fmt: skip
    if (d / "modules.json").exists() and len(_read_json(d / "modules.json")) != 1:
        raise UnsupportedEncoder("a cross-encoder whose modules.json holds more than its "
                                 "Transformer is not served")  # fmt: skip
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
    st_path = d / "config_sentence_transformers.json"
    st = _read_json(st_path) if st_path.exists() else {}
    act_path = (st.get("activation_fn") or (cfg.get("sentence_transformers") or {}).get("activation_fn")
                or cfg.get("sbert_ce_default_activation_function"))  # fmt: skip
    if fam == "mpnet":
        raise UnsupportedEncoder("MPNet cross-encoders are not served (MPNet embedders are)")
    if act_path is None:
        act = "sigmoid" if labels == 1 else "identity"
    else:
        name = str(act_path).rsplit(".", 1)[-1]
        if name not in SCORE_ACTIVATIONS:
            raise UnsupportedEncoder(f"cross-encoder activation {act_path!r} is not one of "
                                     f"{', '.join(SCORE_ACTIVATIONS)}")  # fmt: skip
        act = SCORE_ACTIVATIONS[name]
    return EncoderSpec(family=fam, pooling=(), task="score", num_labels=labels,
                       score_activation=act)


def _is_cross_encoder(d: Path, cfg: dict) -> bool:
    if any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or []):
        return True
    st = d / "config_sentence_transformers.json"
    return st.exists() and _read_json(st).get("model_type") == "CrossEncoder"


def read_spec(model_dir: str | Path) -> EncoderSpec:
    """The whole spec of an encoder directory, from its config files alone (no
    weights read); UnsupportedEncoder, in one line, for what cannot be served."""
    d = Path(model_dir)
    cfg = _read_json(d / "config.json")
    fam = family(cfg)
    if _is_cross_encoder(d, cfg):
        if fam == "decoder":
            raise UnsupportedEncoder("a decoder-based reranker (it scores by its next-token "
                                     "logits) is not served; decoder-based embedders are")
        return _cross_encoder(d, cfg, fam)
    prompts, default = read_prompts(d)
    if not (d / "modules.json").exists():
        return EncoderSpec(family=fam, pooling=("mean",), prompts=prompts,
                           default_prompt_name=default, sentence_transformers=False)
    pooling, dense, normalize = _modules(d)
    return EncoderSpec(family=fam, pooling=pooling, dense=dense, normalize=normalize,
                       prompts=prompts, default_prompt_name=default)


def pooled_dim(spec: EncoderSpec, hidden: int) -> int:
    """Width of the vectors the spec gives for a `hidden`-wide transformer (a
    cross-encoder: its number of labels)."""
    if spec.task == "score":
        return spec.num_labels
    dim = hidden * len(spec.pooling)
    for layer in spec.dense:
        if layer.in_features != dim:
            raise UnsupportedEncoder(f"Dense layer {layer.path} takes {layer.in_features} "
                                     f"features but receives {dim}")  # fmt: skip
        dim = layer.out_features
    return dim


def dense_weights(model_dir: str | Path, spec: EncoderSpec) -> list[dict]:
    """Each Dense layer's weights as float32 numpy, [in, out] like the engines' other
    matmuls: {"w": [IN, OUT], "b": [OUT] (zeros without a bias), "r": [IN, OUT] or
    None (the residual projection)}. Imports numpy and the weights reader only here."""
    import numpy as np

    from engine.weights import load_weights

    out = []
    for layer in spec.dense:
        w = load_weights(Path(model_dir) / layer.path)
        b = w.get("linear.bias") if layer.bias else None
        r = None
        if layer.residual:
            r = (np.asarray(w["residual.weight"], np.float32).T
                 if "residual.weight" in w else np.eye(layer.in_features, dtype=np.float32))
        out.append({
            "w": np.asarray(w["linear.weight"], np.float32).T,  # [IN, OUT]
            "b": np.zeros(layer.out_features, np.float32) if b is None else np.asarray(b, np.float32),
            "r": r,  # [IN, OUT] or None
        })  # fmt: skip
    return out
