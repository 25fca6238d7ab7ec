"""Whether a worker would serve a model directory, read from its config files alone
(no jax, no weights): what `tensorbus registry push` warns of before it uploads.

Here, in the library every service may use, so that the registry's command line does
not import a service's package. The worker refuses the same models at start
(services.worker.engines.check_encoder and check_decoder, exit 78).
"""

from __future__ import annotations

from pathlib import Path


def encoder_refusal(path: str | Path) -> str | None:
    """Why no worker would serve the encoder in `path`, in one line, from its config
    files alone; None when one would."""
    from engine.encoder.config import BertConfig
    from engine.encoder.spec import UnsupportedEncoder

    try:
        spec = BertConfig(path).spec
    except UnsupportedEncoder as exc:
        return str(exc)
    except KeyError as exc:
        return f"config.json has no {exc} field"
    if spec.task == "score" and spec.num_labels != 1:  # rerank and score: one per pair
        return (f"a cross-encoder with {spec.num_labels} labels; the rerank and score "
                f"endpoints serve cross-encoders that give one score per pair")
    return None


def decoder_refusal(path: str | Path) -> str | None:
    """Why no worker would serve the decoder in `path`, as far as its config.json's
    `quantization_config` tells (engine/prequant.py: bitsandbytes, AWQ gemv ...);
    None when that is served. Its architecture is checked by the worker at start
    only: the decoder engine's config module comes with jax."""
    import json

    from engine.prequant import UnsupportedQuantization, scheme

    try:
        scheme(json.loads((Path(path) / "config.json").read_text()))
    except UnsupportedQuantization as exc:
        return str(exc)
    return None
