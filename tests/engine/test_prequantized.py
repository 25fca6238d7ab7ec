"""Checkpoints stored quantized by their publisher (engine/prequant.py): FP8 served
exactly as its dequantized weights (AWQ and GPTQ: tests/engine/test_packed_ints.py),
every other method and layout refused by name.

A tiny Llama is built by transformers (tests/support/tiny_models.py); its linear
weights are quantized here with torch to float8_e4m3fn, as a publisher's tool does
(scale = amax / 448 over each tensor, output channel or block), and saved in three
layouts: compressed-tensors per channel (bfloat16 scales, dynamic activations),
compressed-tensors per tensor (static input scales, some modules left float), and
transformers' block-scaled "fp8" (`weight_scale_inv` per 24 x 40 block: blocks that
do not divide the weights, so the edge blocks are cut). The reference is
transformers' same model with the dequantized weights (q.float() * scale) put in:
the engine's logits on each FP8 checkpoint equal its, and so do the served greedy
tokens on one of them.
"""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import prequant
from engine.decoder.config import UnsupportedDecoder, from_dict
from engine.weights import load_weights
from tests.support.prequant_checks import CONTEXT, assert_logits_equal, assert_served_greedy_equal
from tests.support.tiny_models import build, write_tokenizer
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = (24, 40)

# name -> (quantization_config, scale layout, scale tensor suffix, scale dtype,
#          modules left float, extra tensors a publisher stores beside each weight)
VARIANTS = {
    "ct-channel": ({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                        "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}},
    }, "channel", "weight_scale", torch.bfloat16, (), ()),
    "ct-tensor": ({
        "quant_method": "compressed-tensors", "format": "naive-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*layers[.]1[.]mlp.*"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                        "strategy": "tensor", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "strategy": "tensor", "dynamic": False}}},
    }, "tensor", "weight_scale", torch.float32, ("layers.1.mlp.",), ("input_scale",)),
    "fp8-block": ({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head"],
    }, BLOCK, "weight_scale_inv", torch.float32, (), ()),
}  # fmt: skip


def _spread(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each scale of a [rows, cols] grid over the block it covers, cut at the edges."""
    rows, cols = block
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def _quantize(w: torch.Tensor, layout, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, stored scale, dequantized float32 weight) of an [out, in] weight."""
    out, inn = w.shape
    w = w.float()
    if layout == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
    elif layout == "channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [out, 1]
    else:
        rows, cols = layout
        a, b = -(-out // rows), -(-inn // cols)
        padded = torch.zeros(a * rows, b * cols)
        padded[:out, :inn] = w.abs()
        scale = padded.view(a, rows, b, cols).amax((1, 3)) / FP8_MAX  # [a, b]
    scale = scale.to(dtype)  # what the file holds
    full = scale.float()
    if layout not in ("tensor", "channel"):
        full = _spread(full, w.shape, layout)
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _write(variant: str, model, out) -> dict[str, torch.Tensor]:
    """Save `model` as the FP8 checkpoint `variant` in out; return its dequantized
    state dict (what transformers would compute with)."""
    qcfg, layout, suffix, dtype, keep, extra = VARIANTS[variant]
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    stored, dequantized = {}, dict(state)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not module.endswith(LINEAR) or \
                any(k in name for k in keep):
            stored[name] = w
            continue
        q, scale, deq = _quantize(w, layout, dtype)
        stored[name], stored[f"{module}.{suffix}"] = q, scale
        for e in extra:
            stored[f"{module}.{e}"] = torch.tensor([0.02])
        dequantized[name] = deq
    out.mkdir(parents=True)
    save_file(stored, str(out / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, transformers on its dequantized weights); "float":
    the model before quantization."""
    root = tmp_path_factory.mktemp("prequantized")
    model = build("llama", root / "float", positions=CONTEXT)
    out = {"float": (root / "float", model)}
    for variant in VARIANTS:
        d = root / variant
        ref = copy.deepcopy(model)
        ref.load_state_dict(_write(variant, model, d))
        out[variant] = (d, ref.eval())
    write_tokenizer(root / "fp8-block")  # the one a DecoderEngine serves
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp8_logits_equal_transformers_on_the_dequantized_weights(checkpoints, variant):
    d, ref = checkpoints[variant]
    assert_logits_equal(d, ref, checkpoints["float"][1])


def test_fp8_weights_are_float32_with_no_scale_left(checkpoints):
    d, _ = checkpoints["ct-tensor"]
    w = load_weights(d)
    assert not [n for n in w if n.rsplit(".", 1)[-1] in prequant.SCALES + prequant.UNUSED]
    assert w["model.layers.0.mlp.up_proj.weight"].dtype == np.float32
    assert {str(a.dtype) for a in w.values()} == {"float32"}


def test_served_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints):
    """The serving path (chunked prefill, paged decode) on the block-scaled checkpoint."""
    d, ref = checkpoints["fp8-block"]
    assert_served_greedy_equal(d, "fp8-block", ref)


def test_group_scales_spread_over_their_inputs():
    """compressed-tensors' "group" strategy: one scale per output row and group of
    inputs, the last group cut at the edge."""
    rng = np.random.default_rng(0)
    w = torch.tensor(rng.standard_normal((6, 20)), dtype=torch.float32)
    scale = torch.stack([w[:, i:i + 8].abs().amax(1) for i in range(0, 20, 8)], 1) / FP8_MAX
    q = (w / _spread(scale, w.shape, (1, 8))).to(torch.float8_e4m3fn)
    want = q.float() * _spread(scale, w.shape, (1, 8))
    import ml_dtypes

    got = prequant.dequantize_weight("x.weight", q.view(torch.uint8).numpy().view(
        ml_dtypes.float8_e4m3fn), scale.numpy(), [(1, 8)])
    np.testing.assert_array_equal(got, want.numpy())


# --- refusals


LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "quantization method 'awq' (version 'gemv'; served: gemm) is not served: use the float "
     "checkpoint with TENSORBUS_QUANT=int4"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False},
     "quantization method 'gptq' (3-bit; served: 2, 4, 8) is not served: use the float "
     "checkpoint with TENSORBUS_QUANT=int8, int4 or fp8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "quantization method 'bitsandbytes' is not served: use the float checkpoint with "
     "TENSORBUS_QUANT=int4"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                       "strategy": "group", "group_size": 128}}}},
     "quantization method 'compressed-tensors' (int4 weights, pack-quantized) is not served: "
     "use the float checkpoint with TENSORBUS_QUANT=int4"),
    ({"quant_method": "hqq", "nbits": 4}, "quantization method 'hqq' is not served"),
]  # fmt: skip


@pytest.mark.parametrize("qcfg,message", REFUSED, ids=[q["quant_method"] for q, _ in REFUSED])
def test_unserved_methods_are_refused_by_name(qcfg, message, tmp_path):
    cfg = {**LLAMA, "quantization_config": qcfg}
    with pytest.raises(UnsupportedDecoder) as exc:
        from_dict(cfg)
    assert str(exc.value).startswith(message)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(prequant.UnsupportedQuantization, match=f"'{qcfg['quant_method']}'"):
        load_weights(tmp_path)  # before any tensor is read as float


def test_worker_exits_78_and_push_warns_naming_the_method(tmp_path, capsys):
    from services.registry.cli import serving_warning
    from services.worker.engines import check_decoder, check_encoder
    from shared import catalog
    from tests.services.test_registry import make_encoder_dir

    awq = {"quant_method": "awq", "bits": 4, "version": "gemv"}
    dec = tmp_path / "dec"
    dec.mkdir()
    (dec / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": awq}))
    with pytest.raises(SystemExit) as exc:
        check_decoder(catalog.describe("dec", dec), "jax")
    assert exc.value.code == 78 and "quantization method 'awq'" in capsys.readouterr().err
    assert "quantization method 'awq' (version 'gemv'; served: gemm) is not served" in \
        serving_warning(dec)

    enc = make_encoder_dir(tmp_path / "enc")
    cfg = json.loads((enc / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 3}
    (enc / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as exc:
        check_encoder(catalog.describe("enc", enc))
    assert exc.value.code == 78 and "quantization method 'gptq'" in capsys.readouterr().err
    assert "quantization method 'gptq' (3-bit; served: 2, 4, 8) is not served" in \
        serving_warning(enc)


def test_float8_without_its_scale_is_refused(tmp_path):
    """A float8 weight never reaches the engine unscaled: no quantization_config, or
    a served one with the weight's scale missing, is an error naming the tensor."""
    q = torch.ones(4, 4).to(torch.float8_e4m3fn)
    save_file({"model.layers.0.mlp.up_proj.weight": q}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(prequant.UnsupportedQuantization,
                       match="up_proj.weight.*no quantization_config"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {**LLAMA, "quantization_config": VARIANTS["fp8-block"][0]}))
    with pytest.raises(prequant.UnsupportedQuantization, match="up_proj.weight.*no scale"):
        load_weights(tmp_path)
