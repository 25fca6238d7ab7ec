"""The same BERT sentence encoder in plain torch: the second engine.

It reads the same safetensors weights through `engine.weights` and implements the same
`engine.interface.Encoder`, so a worker can run either (`TENSORBUS_ENGINE=torch`)
without the serving layer noticing. Eager mode under `torch.inference_mode()`;
inputs are grouped by `buckets.plan` like the JAX engine, but each group is padded
only to its longest input, since eager torch has nothing to recompile. The same
families (BERT, RoBERTa / XLM-RoBERTa) and sentence-transformers heads (pooling,
Dense, Normalize; engine/encoder/spec.py) as the JAX engine, refused alike.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F

from engine import buckets as bk
from engine.dtypes import canonical_dtype
from engine.encoder.config import BertConfig, check_plain_bert, relative_buckets
from engine.encoder.spec import dense_weights
from engine.weights import COMMON_PREFIXES, load_weights, strip_prefix

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tensor(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(dtype).contiguous()


class _Layer:
    def __init__(self, w: dict, i: int, dtype: torch.dtype, names: dict[str, str]) -> None:
        p = f"encoder.layer.{i}."

        def t(role: str, part: str, dt: torch.dtype = dtype) -> torch.Tensor:
            return _tensor(w[p + names[role] + "." + part], dt)

        # Q, K, V as one [3D, D] weight: one matmul instead of three.
        self.qkv_w = torch.cat([t(n, "weight") for n in ("q", "k", "v")])
        self.qkv_b = torch.cat([t(n, "bias") for n in ("q", "k", "v")])
        self.o_w, self.o_b = t("o", "weight"), t("o", "bias")
        self.ln1 = (t("ln1", "weight", torch.float32), t("ln1", "bias", torch.float32))
        self.i_w, self.i_b = t("i", "weight"), t("i", "bias")
        self.f_w, self.f_b = t("f", "weight"), t("f", "bias")
        self.ln2 = (t("ln2", "weight", torch.float32), t("ln2", "bias", torch.float32))


def _layer_norm(x: torch.Tensor, gb: tuple[torch.Tensor, torch.Tensor], eps: float):
    """x: [B, S, D]; statistics in float32 whatever the compute dtype."""
    y = F.layer_norm(x.float(), (x.shape[-1],), gb[0], gb[1], eps)
    return y.to(x.dtype)


_HEAD_ACTS = {
    "identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu,
    "sigmoid": torch.sigmoid, "silu": F.silu,
}  # fmt: skip


class TorchEncoder:
    """`engine.interface.Encoder` in eager torch, same constructor as `EncoderEngine`."""

    def __init__(
        self,
        model_dir: str | Path,
        name: str = "all-MiniLM-L6-v2",
        dtype: str = "float32",
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        seq_buckets: Sequence[int] = (16, 32, 64, 128, 256),
        max_batch: int = 64,
    ) -> None:
        self.cfg = BertConfig(model_dir)
        check_plain_bert(self.cfg)
        self.name = name
        self.task = "embed"
        self.dtype = canonical_dtype(dtype)
        self.device = "cpu"
        self.devices = [self.device]
        self.dim = self.cfg.dim
        self.normalize = self.cfg.spec.normalize  # vectors L2-normalised (a Normalize module)
        self.prompts = dict(self.cfg.spec.prompts)  # name -> prefix text, for the gateway
        self.default_prompt_name = self.cfg.spec.default_prompt_name
        self.max_tokens = self.cfg.max_tokens
        self.batch_buckets = bk.parse(batch_buckets)
        seqs = tuple(s for s in bk.parse(seq_buckets) if s < self.max_tokens)
        self.seq_buckets = seqs + (self.max_tokens,)
        self.max_batch = min(int(max_batch), self.batch_buckets[-1])
        self._dt = _TORCH_DTYPES[self.dtype]
        w = strip_prefix(load_weights(model_dir), COMMON_PREFIXES + ("mpnet.",))
        types = "embeddings.token_type_embeddings.weight"  # MPNet has none
        type0 = _tensor(w[types], self._dt)[0] if types in w else 0.0
        self.word = _tensor(w["embeddings.word_embeddings.weight"], self._dt)  # [V, D]
        start = self.cfg.position_offset  # RoBERTa: pad_id + 1
        self.pos = _tensor(w["embeddings.position_embeddings.weight"][start:], self._dt) + type0
        self.emb_ln = (_tensor(w["embeddings.LayerNorm.weight"], torch.float32),
                       _tensor(w["embeddings.LayerNorm.bias"], torch.float32))  # fmt: skip
        self.layers = [_Layer(w, i, self._dt, self.cfg.names) for i in range(self.cfg.layers)]
        rel = "encoder.relative_attention_bias.weight"  # MPNet: [buckets, H]
        self.rel_bias = _tensor(w[rel], torch.float32) if rel in w else None
        # Dense layers after pooling, float32, as [OUT, IN] for F.linear.
        self.head = [{k: None if v is None else torch.from_numpy(v.T.copy()) for k, v in h.items()}
                     for h in dense_weights(model_dir, self.cfg.spec)]  # fmt: skip
        self._lock = threading.Lock()

    # --- the math

    def _attention(self, qkv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """qkv: [B, S, 3D]; keep: [B, 1, 1, S] bool, or [B, H, S, S] float in the compute
        dtype (a relative position bias, -inf on padding keys) -> [B, S, D]."""
        b, s, _ = qkv.shape
        h = self.cfg.heads
        q, k, v = qkv.view(b, s, 3, h, -1).permute(2, 0, 3, 1, 4)  # each [B, H, S, K]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [B, H, S, K]
        return ctx.transpose(1, 2).reshape(b, s, self.cfg.hidden)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            return F.gelu(x, approximate="tanh")
        if self.cfg.act == "relu":
            return F.relu(x)
        return F.gelu(x)

    def _pool(self, x: torch.Tensor, m: torch.Tensor, mode: str) -> torch.Tensor:
        """x: [B, S, D] float32; m: [B, S, 1] float32 0/1, right padding -> [B, D]."""
        if mode == "cls":
            return x[:, 0]
        if mode == "lasttoken":
            last = (m.sum(1).long() - 1).clamp(min=0)  # [B, 1]
            return x.gather(1, last[:, :, None].expand(-1, 1, x.shape[-1]))[:, 0]
        if mode == "max":
            return x.masked_fill(m == 0, float("-inf")).max(1).values
        if mode == "weightedmean":
            m = m * torch.arange(1, m.shape[1] + 1, dtype=torch.float32)[None, :, None]
        count = m.sum(1).clamp(min=1e-9)  # [B, 1]
        return (x * m).sum(1) / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)

    def _head(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] token states -> [B, dim] float32: pooling, Dense, Normalize."""
        spec = self.cfg.spec
        m = mask.to(torch.float32).unsqueeze(-1)  # [B, S, 1]
        y = torch.cat([self._pool(x.float(), m, mode) for mode in spec.pooling], dim=-1)
        for layer, p in zip(spec.dense, self.head):
            out = _HEAD_ACTS[layer.activation](F.linear(y, cast(torch.Tensor, p["w"]), p["b"]))
            y = out + F.linear(y, p["r"]) if p["r"] is not None else out
        return F.normalize(y, p=2.0, dim=1) if spec.normalize else y

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: [B, S] int64 -> [B, dim] float32 sentence embeddings."""
        eps = self.cfg.eps
        x = self.word[ids] + self.pos[: ids.shape[1]]  # [B, S, D]
        x = _layer_norm(x, self.emb_ln, eps)
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        if self.rel_bias is not None:  # MPNet: the same relative position bias in every layer
            buckets = torch.from_numpy(relative_buckets(ids.shape[1])).long()  # [S, S]
            rel = self.rel_bias[buckets].permute(2, 0, 1)[None]  # [1, H, S, S]
            pad = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))  # [B, 1, 1, S]
            keep = (rel + pad).to(self._dt)  # [B, H, S, S]
        for p in self.layers:
            attn = F.linear(self._attention(F.linear(x, p.qkv_w, p.qkv_b), keep), p.o_w, p.o_b)
            x = _layer_norm(attn + x, p.ln1, eps)
            y = F.linear(self._act(F.linear(x, p.i_w, p.i_b)), p.f_w, p.f_b)  # [B, S, D]
            x = _layer_norm(y + x, p.ln2, eps)
        return self._head(x, mask)

    # --- the engine

    def close(self, wait_s: float = 0.0) -> bool:
        return True  # nothing compiles

    def program_counts(self) -> tuple[int, int]:
        return 0, 0  # eager: nothing compiled

    def warmup(self, progress: bool = True) -> int:
        """Run one forward per sequence bucket (thread pool and allocator warm).
        Eager torch compiles nothing, so the count of compiled shapes is 0."""
        from tqdm import tqdm

        for s in tqdm(self.seq_buckets, desc=f"warm {self.name}", disable=not progress,
                      leave=False):  # fmt: skip
            ids = torch.full((1, s), self.cfg.pad_id, dtype=torch.long)
            with torch.inference_mode():
                self.forward(ids, torch.ones_like(ids))
        return 0

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.empty((len(inputs), self.dim), dtype=np.float32)  # [N, D]
        if not inputs:
            return out
        lengths = [len(x) for x in inputs]
        bk.check_lengths(lengths, self.max_tokens)
        groups = bk.plan(lengths, self.batch_buckets, self.seq_buckets, self.max_batch)
        with self._lock, torch.inference_mode():
            for rows, _, _ in groups:
                seqs = [inputs[r] for r in rows]
                width = max(len(x) for x in seqs)
                ids, mask = bk.pad(seqs, len(seqs), width, self.cfg.pad_id)  # [b, w]
                res = self.forward(torch.from_numpy(ids).long(), torch.from_numpy(mask))
                out[rows] = res.numpy()
        return out
