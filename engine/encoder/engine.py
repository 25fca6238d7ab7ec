"""The encoder engine: what a worker calls, `engine.interface.Encoder` (and, for a
cross-encoder, `Reranker`) over one jitted forward and bucketed shapes.

Dataflow of one `EncoderEngine.embed` (or `score`) call:
  1. `buckets.plan` sorts the inputs by length and groups them into padded batches of
     bucketed shape (at most `max_batch` rows each);
  2. each group is padded to int32 ids + mask [B, S] (and a pair's token types) and
     dispatched to the single jitted `forward` / `score_forward`
     (engine/encoder/model.py; one executable per bucket, all compiled at warm-up);
     dispatch is asynchronous, so the next group is padded while the previous one runs;
  3. the [B, D] float32 outputs come back in one `device_get` and are written into
     their input order.
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
from engine.encoder.config import BertConfig
from engine.encoder.model import decoder_forward, forward, score_forward
from engine.encoder.params import Params, load_params
from engine.quant import check_mode, tree_bytes

# Padded tokens per executed group. On the 2-core Zen 2 development machine (16 MB L3),
# 64 inputs of 128 tokens embed at 40 sentences/s as one group and 44 as eight groups
# of 8; 64 x 16 stays one group (360/s, against 315/s as four of 16).
TOKEN_BUDGET = 1024


class EncoderEngine:
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
        if self.cfg.family == "decoder":
            return decoder_forward(params, ids, mask, self.cfg)
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
