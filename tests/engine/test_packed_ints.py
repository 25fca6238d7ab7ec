"""AWQ and GPTQ checkpoints (engine/packed_ints.py): served as the float32 weights
their packed integers stand for.

A tiny Llama is built by transformers (tests/support/tiny_models.py); its linear
weights are quantized here, asymmetric per group of inputs and output column (a
float16 scale, an integer zero point), and packed as the publishers' tools pack them:
AutoAWQ's GEMM layout (words along the outputs, AWQ's interleaved column order) and
GPTQ's (words along the inputs; zero points along the outputs, v1 minus one, v2 as
they are; act-order's `g_idx` a permutation of the inputs' groups). The reference is
transformers' same model with (q - zero) * scale put in as its weights: the
engine's logits on each checkpoint equal its, and so do the served greedy tokens.
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
from engine.weights import load_weights
from tests.support.prequant_checks import CONTEXT, assert_logits_equal, assert_served_greedy_equal
from tests.support.tiny_models import build, write_tokenizer
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: the k-th 4 bits of a word hold column AWQ_PACK[k]
GROUP = 32

# name -> (quantization_config, bits, act-order)
VARIANTS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
             "zero_point": True, "modules_to_not_convert": None}, 4, False),
    "gptq-v1-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                           "desc_act": True, "sym": False}, 4, True),
    "gptq-v2-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False,
                      "checkpoint_format": "gptq_v2"}, 8, False),
}  # fmt: skip


def _quantize(w: np.ndarray, bits: int, groups: np.ndarray):
    """w [IN, OUT] float32, groups [IN] each input's group -> (q [IN, OUT], zero
    [G, OUT] integers, scale [G, OUT] float16, (q - zero) * scale [IN, OUT] float32)."""
    top = (1 << bits) - 1
    n = int(groups.max()) + 1
    lo = np.stack([w[groups == g].min(0) for g in range(n)])
    hi = np.stack([w[groups == g].max(0) for g in range(n)])
    scale = np.maximum((hi - lo) / top, 1e-4).astype(np.float16)
    s = scale.astype(np.float32)
    zero = np.clip(np.rint(-lo / s), 1, top).astype(np.int64)  # GPTQ v1 cannot store 0
    q = np.clip(np.rint(w / s[groups]) + zero[groups], 0, top).astype(np.int64)
    return q, zero, scale, ((q - zero[groups]) * s[groups]).astype(np.float32)


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Integers -> int32 words of 32 / bits along `axis`, the k-th `bits` of a word
    holding value order[k] of its run (plain order by default)."""
    per = 32 // bits
    v = np.moveaxis(values, axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per).astype(np.uint32)
    word = np.zeros(v.shape[:-1], np.uint32)
    for k, at in enumerate(order or range(per)):
        word |= v[..., at] << np.uint32(bits * k)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), -1, axis))


def _write(variant: str, model, out, rng) -> dict[str, torch.Tensor]:
    """Save `model` as the packed checkpoint `variant` in out (its float tensors as
    float16, as published); return the state dict transformers computes with."""
    qcfg, bits, act_order = VARIANTS[variant]
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    stored, ref = {}, dict(state)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not module.endswith(LINEAR):
            stored[name] = w.half()
            ref[name] = w.half().float()
            continue
        wt = w.numpy().T  # [IN, OUT]
        inn = wt.shape[0]
        groups = np.arange(inn) // GROUP
        if act_order:
            groups = groups[rng.permutation(inn)]  # each input's group: a permutation
        q, zero, scale, deq = _quantize(wt, bits, groups)
        if qcfg["quant_method"] == "awq":
            stored[module + ".qweight"] = torch.from_numpy(_pack(q, bits, 1, AWQ_PACK))
            stored[module + ".qzeros"] = torch.from_numpy(_pack(zero, bits, 1, AWQ_PACK))
        else:
            z = zero if qcfg.get("checkpoint_format") == "gptq_v2" else (zero - 1) & ((1 << bits) - 1)
            stored[module + ".qweight"] = torch.from_numpy(_pack(q, bits, 0))
            stored[module + ".qzeros"] = torch.from_numpy(_pack(z, bits, 1))
            stored[module + ".g_idx"] = torch.from_numpy(groups.astype(np.int32))
        stored[module + ".scales"] = torch.from_numpy(scale)
        ref[name] = torch.from_numpy(np.ascontiguousarray(deq.T))
    out.mkdir(parents=True)
    save_file(stored, str(out / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, transformers on its dequantized weights)."""
    root = tmp_path_factory.mktemp("packed")
    model = build("llama", root / "float", positions=CONTEXT)
    rng = np.random.default_rng(3)
    out = {"float": (root / "float", model)}
    for variant in VARIANTS:
        ref = copy.deepcopy(model)
        ref.load_state_dict(_write(variant, model, root / variant, rng))
        out[variant] = (root / variant, ref.eval())
    write_tokenizer(root / "awq")  # the one a DecoderEngine serves
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_logits_equal_transformers_on_the_dequantized_weights(checkpoints, variant):
    d, ref = checkpoints[variant]
    assert_logits_equal(d, ref, checkpoints["float"][1])


def test_packed_layers_become_float32_weights_with_nothing_packed_left(checkpoints):
    d, _ = checkpoints["gptq-v1-act-order"]
    w = load_weights(d)
    assert not [n for n in w if n.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")]
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert w["model.layers.0.mlp.down_proj.weight"].dtype == np.float32


def test_served_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints):
    """The serving path (chunked prefill, paged decode) on the AWQ checkpoint."""
    d, ref = checkpoints["awq"]
    assert_served_greedy_equal(d, "awq", ref)


@pytest.mark.parametrize("qcfg,why", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'; served: gemm"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point False"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit; served: 2, 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
])  # fmt: skip
def test_packed_layouts_not_served_are_refused_naming_why(qcfg, why):
    with pytest.raises(prequant.UnsupportedQuantization) as exc:
        prequant.scheme({"quantization_config": qcfg})
    assert why in str(exc.value) and f"'{qcfg['quant_method']}'" in str(exc.value)


def test_a_packed_layer_of_the_wrong_shape_is_refused(checkpoints, tmp_path):
    """A group size that does not fit the stored zero points: an error naming the
    layer, never weights read with the wrong groups."""
    d, _ = checkpoints["awq"]
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 16  # the file's groups are of 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(d / "model.safetensors")
    with pytest.raises(prequant.UnsupportedQuantization, match="does not fit 4-bit awq"):
        load_weights(tmp_path)
