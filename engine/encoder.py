"""BERT sentence encoder as pure JAX functions over a parameter pytree.

Dataflow of one `JaxEncoder.embed` call:
  1. `buckets.plan` sorts the inputs by length and groups them into padded batches of
     bucketed shape (at most `max_batch` rows each);
  2. each group is padded to int32 ids + mask [B, S] and dispatched to the single
     jitted `forward` (one executable per bucket, all compiled at warm-up); dispatch
     is asynchronous, so the next group is padded while the previous one runs;
  3. the pooled [B, D] float32 outputs come back in one `device_get` and are written
     into their input order.

`forward` = embeddings -> L x (fused-QKV attention, GELU MLP, post-LayerNorm) ->
the model's own sentence-transformers head (engine/encoder_spec.py): pooling over
the mask (CLS, mean, max, mean/sqrt(len), weighted mean, last token, concatenated in
sentence-transformers' order), its Dense layers, and L2 normalisation when it has a
Normalize module. BERT and RoBERTa / XLM-RoBERTa differ only in where positions
start (engine/bert_config.py). Matmuls run in the model dtype; LayerNorm, softmax,
pooling and the head in float32.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine import buckets as bk
from engine import jaxrt, sharding
from engine.quant import QWeight, check_mode, quantize_tree, take_rows, tree_bytes
from engine.quant import cast_tree as quant_tree
from engine.quant import matmul as qmatmul
from engine.sharding import shard_major
from engine.bert_config import BertConfig, relative_buckets
from engine.encoder_spec import dense_weights
from engine.weights import COMMON_PREFIXES, load_weights, strip_prefix

Params = dict[str, Any]


# --- parameters


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
    w = strip_prefix(load_weights(model_dir), COMMON_PREFIXES + ("mpnet.",))
    dt = jaxrt.parse_dtype(dtype)
    start = cfg.position_offset  # first position a token takes (RoBERTa: pad_id + 1)

    def f32(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float32)

    def dense(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        return f32(prefix + ".weight").T, f32(prefix + ".bias")  # [in, out], [out]

    layers = []
    tp = 1 if mesh is None else mesh.devices.size
    d = cfg.hidden
    names = cfg.names  # role -> the family's name for it (engine/bert_config.py)
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


# --- the math (pure functions; shapes: B batch, S seq, D hidden, H heads, K head dim)


def _layer_norm(x, g, b, eps: float):
    """x: [..., D] any float dtype -> same dtype; statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * g + b
    return y.astype(x.dtype)


def _gelu(x, act: str):
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return jax.nn.gelu(x, approximate=True)
    if act == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=False)  # HF "gelu" is the exact erf form


def _attention(qkv, bias, heads: int, tp: int = 1):
    """qkv: [B, S, 3D]; bias: [B, 1, 1, S] float32 (0 or a large negative), or [B, H, S, S]
    with a relative position bias added (MPNet) -> [B, S, D].

    One explicit transpose to head-major [3, B, H, S, K] up front: XLA's CPU batched
    dot then runs on contiguous [S, K] tiles; letting einsum pick the layout from
    [B, S, H, K] measured 15-20% slower end to end at S >= 128 (no change at S=16).
    Split over `tp` devices, qkv's columns are shard-major: [B, S, TP, 3, H/TP, K]."""
    b, s, three_d = qkv.shape
    d = three_d // 3
    k_dim = d // heads
    if tp == 1:
        qkv = qkv.reshape(b, s, 3, heads, k_dim).transpose(2, 0, 3, 1, 4)  # [3, B, H, S, K]
    else:
        qkv = qkv.reshape(b, s, tp, 3, heads // tp, k_dim).transpose(3, 0, 2, 4, 1, 5)
        qkv = qkv.reshape(3, b, heads, s, k_dim)  # [3, B, H, S, K], head order kept
    q, k, v = qkv[0], qkv[1], qkv[2]  # each [B, H, S, K]
    q = q * jnp.asarray(1.0 / np.sqrt(k_dim), q.dtype)  # scale the small operand
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)  # [B, H, S, S]
    ctx = jnp.einsum("bhqs,bhsk->bhqk", probs, v)  # [B, H, S, K]
    return ctx.transpose(0, 2, 1, 3).reshape(b, s, d)  # [B, S, D]


def _mm(x, w):
    """x: [..., IN] @ w: [IN, OUT] (float, or a QWeight) -> [..., OUT]"""
    if isinstance(w, QWeight):
        return qmatmul(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (-1,))
    return x @ w


def _layer(x, bias, p: Params, cfg: BertConfig, tp: int = 1):
    """x: [B, S, D] -> [B, S, D]: post-LN BERT block."""
    qkv = _mm(x, p["qkv_w"]) + p["qkv_b"]  # [B, S, 3D]
    attn = _mm(_attention(qkv, bias, cfg.heads, tp), p["o_w"]) + p["o_b"]  # [B, S, D]
    x = _layer_norm(attn + x, p["ln1_g"], p["ln1_b"], cfg.eps)
    h = _gelu(_mm(x, p["i_w"]) + p["i_b"], cfg.act)  # [B, S, F]
    y = _mm(h, p["f_w"]) + p["f_b"]  # [B, S, D]
    return _layer_norm(y + x, p["ln2_g"], p["ln2_b"], cfg.eps)


def _pool(x32, m, mode: str):
    """x32: [B, S, D] float32, m: [B, S] float32 0/1 (right padding) -> [B, D],
    as sentence-transformers' Pooling computes `mode`."""
    if mode == "cls":
        return x32[:, 0]  # right padding: the first token is always real
    if mode == "lasttoken":
        last = jnp.maximum(jnp.sum(m, axis=1).astype(jnp.int32) - 1, 0)  # [B]
        return jnp.take_along_axis(x32, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return jnp.max(jnp.where(m[:, :, None] > 0, x32, -jnp.inf), axis=1)
    if mode == "weightedmean":
        m = m * jnp.arange(1, m.shape[1] + 1, dtype=jnp.float32)[None, :]  # weight i + 1
    summed = jnp.einsum("bsd,bs->bd", x32, m)  # [B, D]
    count = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1e-9)  # [B, 1]
    return summed / (jnp.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


_HEAD_ACTS = {
    "identity": lambda x: x, "tanh": jnp.tanh, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False), "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
}  # fmt: skip


def head(params: Params, x32, m, cfg: BertConfig):
    """x32: [B, S, D] float32 token states -> [B, dim] float32: the model's pooling,
    Dense layers and (when it has one) Normalize."""
    spec = cfg.spec
    y = jnp.concatenate([_pool(x32, m, mode) for mode in spec.pooling], axis=-1)  # [B, P]
    for layer, p in zip(spec.dense, params["head"]):
        out = _HEAD_ACTS[layer.activation](y @ p["head_w"] + p["head_b"])  # [B, OUT]
        y = out + y @ p["head_r"] if "head_r" in p else out
    if spec.normalize:
        norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=1, keepdims=True))  # [B, 1]
        y = y / jnp.maximum(norm, 1e-12)
    return y


def encode(params: Params, ids, mask, cfg: BertConfig, tp: int = 1, types=None):
    """ids, mask (and a pair's token types): [B, S] int32 -> (token states [B, S, D]
    in the model dtype, mask [B, S] float32). `tp`: devices the heads are split over
    (the layout of the fused QKV columns)."""
    s = ids.shape[1]
    word, pos = params["word"], params["pos"]  # pos: [P, D] in the model dtype
    x = take_rows(word, ids, jnp.float32).astype(jnp.float32) + pos[:s].astype(jnp.float32)
    if types is not None:  # type 0 is already in `pos`; the table holds the differences
        x = x + params["types"][types].astype(jnp.float32)
    x = _layer_norm(x, params["emb_ln_g"], params["emb_ln_b"], cfg.eps).astype(pos.dtype)
    m = mask.astype(jnp.float32)  # [B, S]
    # Padding keys get a large negative logit (not -inf: an all-padding row of a
    # padded batch must stay finite, its output is discarded anyway).
    bias = ((m - 1.0) * 1e9)[:, None, None, :]  # [B, 1, 1, S]
    if "rel_bias" in params:  # MPNet: the same relative position bias in every layer
        buckets = relative_buckets(s)  # [S, S], static: S is the bucket's length
        rel = params["rel_bias"][buckets].transpose(2, 0, 1)  # [H, S, S]
        bias = bias + rel[None]  # [B, H, S, S]
    for p in params["layers"]:
        x = _layer(x, bias, p, cfg, tp)
    return x, m


def forward(params: Params, ids, mask, cfg: BertConfig, tp: int = 1):
    """ids, mask: [B, S] int32 -> [B, dim] float32 sentence embeddings (`head`)."""
    x, m = encode(params, ids, mask, cfg, tp)
    return head(params, x.astype(jnp.float32), m, cfg)  # [B, dim]


def score_forward(params: Params, ids, mask, types, cfg: BertConfig, tp: int = 1):
    """A cross-encoder: ids, mask, token types of text pairs: [B, S] int32 -> [B, L]
    float32 scores. CLS state -> dense, tanh (BERT's pooler; RoBERTa's classifier
    head has the same shape) -> L logits -> the model's activation."""
    x, _ = encode(params, ids, mask, cfg, tp, types)
    c = params["classifier"]
    h = jnp.tanh(x[:, 0].astype(jnp.float32) @ c["cls_w"] + c["cls_b"])  # [B, D]
    return _HEAD_ACTS[cfg.spec.score_activation](h @ c["out_w"] + c["out_b"])  # [B, L]


# --- the engine


# Padded tokens per executed group. On the 2-core Zen 2 development machine (16 MB L3),
# 64 inputs of 128 tokens embed at 40 sentences/s as one group and 44 as eight groups
# of 8; 64 x 16 stays one group (360/s, against 315/s as four of 16).
TOKEN_BUDGET = 1024


class JaxEncoder:
    """`engine.interface.Encoder` over one jitted `forward` and bucketed shapes."""

    def __init__(
        self,
        model_dir: str | Path,
        name: str = "all-MiniLM-L6-v2",
        dtype: str = "float32",
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        seq_buckets: Sequence[int] = (16, 32, 64, 128, 256),
        max_batch: int = 64,
        token_budget: int | None = TOKEN_BUDGET,
        tensor_parallel: int = 1,
        quant: str = "none",
    ) -> None:
        self.cfg = BertConfig(model_dir)
        self.name = name
        self.quant = check_mode(quant)
        if self.quant == "gguf":
            raise ValueError("quantization 'gguf' keeps a GGUF decoder's blocks; encoders "
                             "use int8, int4 or fp8")  # fmt: skip
        self.tp = sharding.parse(tensor_parallel)
        if self.tp > 1:
            sharding.check_divisible(name, self.tp, attention_heads=self.cfg.heads,
                                     mlp_columns=self.cfg.intermediate)  # fmt: skip
        self._mesh = sharding.make_mesh(self.tp)
        self.devices = sharding.engine_devices(self._mesh)  # e.g. ["cpu:0", "cpu:1"]
        self.token_budget = token_budget  # padded tokens per executed group (buckets.plan)
        self.dtype = jaxrt.dtype_name(dtype)
        self.device = jaxrt.device_name()
        self.dim = self.cfg.dim
        self.normalize = self.cfg.spec.normalize  # vectors L2-normalised (a Normalize module)
        self.prompts = dict(self.cfg.spec.prompts)  # name -> prefix text, for the gateway
        self.default_prompt_name = self.cfg.spec.default_prompt_name
        self.max_tokens = self.cfg.max_tokens
        self.batch_buckets = bk.parse(batch_buckets)
        seqs = tuple(s for s in bk.parse(seq_buckets) if s < self.max_tokens)
        self.seq_buckets = seqs + (self.max_tokens,)  # the limit is always a bucket
        self.max_batch = min(int(max_batch), self.batch_buckets[-1])
        self.params = load_params(model_dir, self.dtype, self.quant, self._mesh)
        self.weight_bytes = tree_bytes(self.params)  # integers and scales when quantized
        self.traces = 0  # times `forward` was traced: one per bucket, at compile
        self.task = self.cfg.spec.task  # "embed", or "score" for a cross-encoder
        self._jitted = jax.jit(self._trace if self.task == "embed" else self._trace_score)
        self._executables: dict[tuple[int, int], Any] = {}  # (B, S) -> compiled
        self._lock = threading.Lock()

    def _trace(self, params: Params, ids, mask):
        self.traces += 1  # runs at trace time only, never per call
        return forward(params, ids, mask, self.cfg, self.tp)

    def _trace_score(self, params: Params, ids, mask, types):
        self.traces += 1
        return score_forward(params, ids, mask, types, self.cfg, self.tp)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return bk.shapes(self.batch_buckets, self.seq_buckets)

    def compiled_count(self) -> int:
        """Executables held: one per bucket once warm, never more."""
        return len(self._executables)

    def _executable(self, b: int, s: int):
        """The compiled forward for one bucket; compiled here if warm-up skipped it.

        Ahead-of-time `lower().compile()` rather than a first call: warm-up compiles
        every bucket without running it (running 64x256 alone is seconds of CPU),
        and an unknown shape can never reach the compiler from the request path."""
        exe = self._executables.get((b, s))
        if exe is None:
            # ids and mask: [B, S], replicated over the devices when split.
            rep = None if self._mesh is None else sharding.replicated(self._mesh)
            spec = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rep)
            args = (spec, spec) if self.task == "embed" else (spec, spec, spec)  # + types
            lowered = self._jitted.lower(self.params, *args)
            exe = self._executables[(b, s)] = jaxrt.compile_lowered(lowered)
        return exe

    def warmup(self, progress: bool = True) -> int:
        from tqdm import tqdm

        shapes = self.shapes
        bar = tqdm(shapes, desc=f"compile {self.name}", disable=not progress, leave=False)
        with self._lock:
            for b, s in bar:
                bar.set_postfix_str(f"{b}x{s}")
                self._executable(b, s)
        return len(shapes)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if self.task != "embed":
            raise ValueError(f"{self.name} is a cross-encoder: it scores text pairs, it "
                             f"does not embed")  # fmt: skip
        return self._run(inputs, None)

    def score(self, inputs: list[list[int]], token_types: list[list[int]]) -> np.ndarray:
        """A cross-encoder's scores: [len(inputs), num_labels] float32, after the
        model's activation (CrossEncoder.predict's). Each input is one text pair as
        its tokenizer encodes it (`[CLS] a [SEP] b [SEP]`, `<s> a </s></s> b </s>`),
        with the pair's token type ids (all 0 for RoBERTa-style models)."""
        if self.task != "score":
            raise ValueError(f"{self.name} embeds texts; scoring pairs needs a cross-encoder")
        if [len(x) for x in inputs] != [len(t) for t in token_types]:
            raise ValueError("each input needs one token type per token")
        return self._run(inputs, token_types)

    def _run(self, inputs: list[list[int]], types: list[list[int]] | None) -> np.ndarray:
        out = np.empty((len(inputs), self.dim), dtype=np.float32)  # [N, D]
        if not inputs:
            return out
        lengths = [len(x) for x in inputs]
        bk.check_lengths(lengths, self.max_tokens)
        groups = bk.plan(lengths, self.batch_buckets, self.seq_buckets, self.max_batch,
                         self.token_budget)
        pending = []
        with self._lock:  # one caller at a time keeps device memory bounded
            for rows, b, s in groups:
                ids, mask = bk.pad([inputs[r] for r in rows], b, s, self.cfg.pad_id)
                args = (ids, mask)
                if types is not None:
                    args += (bk.pad([types[r] for r in rows], b, s, 0)[0],)  # [b, s]
                pending.append(self._executable(b, s)(self.params, *args))  # [b, D]
            results = jax.device_get(pending)  # one transfer for the whole call
        for (rows, _, _), res in zip(groups, results):
            out[rows] = res[: len(rows)]
        return out
