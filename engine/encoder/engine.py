"""The encoder engine: what a worker calls, `engine.interface.Encoder` (and, for a
cross-encoder, `Reranker`) over one jitted forward and bucketed shapes.

Dataflow of one `EncoderEngine.embed` (or `score`) call:
  1. `buckets.plan` sorts the inputs by length and groups them into padded batches of
     bucketed shape (at most `max_batch` rows each);
  2. each group runs on the compiled program of its (batch, sequence) bucket, or,
     while that one is still compiling in the background, on the cheapest compiled
     one that holds it (a larger bucket), else in parts of a smaller compiled batch
     (rows are independent: the vectors are the same);
  3. each part is padded to int32 ids + mask [B, S] (and a pair's token types) and
     dispatched to the jitted `forward` / `score_forward` (engine/encoder/model.py);
     dispatch is asynchronous, so the next part is padded while the previous one runs;
  4. the [B, D] float32 outputs come back in one `device_get` and are written into
     their input order.

Compiles (`compile_ahead`): "all" compiles every bucket at `warmup`; "first"
compiles one input at every length and the shapes of the worker's warm-up timing,
and the rest on a background thread (engine/programs.py), so a worker is ready in a
few programs' time instead of all of them; "lazy" compiles each where first needed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine import buckets as bk
from engine import jaxrt, sharding
from engine.encoder.config import BertConfig
from engine.encoder.model import decoder_forward, forward, score_forward
from engine.encoder.params import Params, load_params
from engine.programs import Programs
from engine.quant import check_mode, tree_bytes

# Padded tokens per executed group. On the 2-core Zen 2 development machine (16 MB L3),
# 64 inputs of 128 tokens embed at 40 sentences/s as one group and 44 as eight groups
# of 8; 64 x 16 stays one group (360/s, against 315/s as four of 16).
TOKEN_BUDGET = 1024
COMPILE_AHEAD = ("all", "first", "lazy")
# Inputs of the batches a worker times after warm-up (services/worker/service.py): a
# first set that holds them keeps that timing on whole batches, not parts.
TIMED_BATCH_TOKENS = (16, 64)


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
        compile_ahead: str = "all",
    ) -> None:
        """compile_ahead: what `warmup` compiles before it returns: "all", "first" (a
        first set, the rest on a background thread) or "lazy" (each where first
        needed)."""
        if compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"compile_ahead {compile_ahead!r}: use one of {', '.join(COMPILE_AHEAD)}")
        self.compile_ahead = compile_ahead
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
        self.programs = Programs(name)  # (B, S) -> compiled
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
        return self.programs.compiled

    def first_shapes(self) -> list[tuple[int, int]]:
        """What `compile_ahead="first"` compiles before ready: one input at every
        length (any request is served from these, in parts), and the groups of the
        worker's warm-up timing (full batches of short and of longer inputs)."""
        first = [(self.batch_buckets[0], s) for s in self.seq_buckets]
        for n in TIMED_BATCH_TOKENS:
            n = min(n, self.max_tokens)
            for _, b, s in bk.plan([n] * self.max_batch, self.batch_buckets, self.seq_buckets,
                                   self.max_batch, self.token_budget):  # fmt: skip
                if (b, s) not in first:
                    first.append((b, s))
        return first

    def _lowering(self, b: int, s: int):
        """A function that lowers the forward of one bucket (not called here).

        Ahead-of-time `lower().compile()` rather than a first call: warm-up compiles
        a bucket without running it (running 64x256 alone is seconds of CPU)."""
        # ids and mask: [B, S], replicated over the devices when split.
        rep = None if self._mesh is None else sharding.replicated(self._mesh)
        spec = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rep)
        args = (spec, spec) if self.task == "embed" else (spec, spec, spec)  # + types
        return lambda: self._jitted.lower(self.params, *args)

    def _executable(self, b: int, s: int):
        """The compiled forward for one bucket; compiled here if nobody has."""
        return self.programs.get((b, s), self._lowering(b, s))

    def warmup(self, progress: bool = True) -> int:
        """Compile what `compile_ahead` says; return how many programs were compiled
        before it returned."""
        from tqdm import tqdm

        shapes = {"all": self.shapes, "first": self.first_shapes(), "lazy": []}[self.compile_ahead]
        bar = tqdm(shapes, desc=f"compile {self.name}", disable=not progress, leave=False)
        with self._lock:
            for b, s in bar:
                bar.set_postfix_str(f"{b}x{s}")
                self._executable(b, s)
        if self.compile_ahead == "first":
            rest = sorted((k for k in self.shapes if k not in shapes), key=lambda k: k[0] * k[1])
            self.programs.start_background([(k, self._lowering(*k)) for k in rest])
        return len(shapes)

    def close(self, wait_s: float = 0.0) -> bool:
        """Compile nothing more in the background; wait up to `wait_s` for the
        program being compiled -> False while one still is (the process should not
        exit then: XLA unwinding under the interpreter's exit aborts it)."""
        self.programs.stop()
        return self.programs.wait_background(wait_s) if wait_s > 0 else not self.programs.compiling

    def _parts(self, rows: np.ndarray, b: int, s: int) -> list[tuple[np.ndarray, int, int]]:
        """`rows` (planned as one group of bucket (b, s)) as groups of compiled
        buckets: its own once compiled, else the cheapest compiled bucket that holds
        it, else parts of the largest compiled batch at a length that holds it; the
        exact bucket, compiled here, when nothing compiled holds its length."""
        if self.programs.has((b, s)) or not self.programs.compiling:
            return [(rows, b, s)]
        done = [k for k in self.programs.keys() if k[1] >= s]
        whole = [k for k in done if k[0] >= len(rows)]
        if whole:
            b2, s2 = min(whole, key=lambda k: k[0] * k[1])
            return [(rows, b2, s2)]
        if not done:
            return [(rows, b, s)]
        b2, s2 = max(done, key=lambda k: (k[0], -k[1]))
        return [(rows[i : i + b2], b2, s2) for i in range(0, len(rows), b2)]

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
        parts = [p for rows, b, s in groups for p in self._parts(rows, b, s)]
        with self._lock:  # one caller at a time keeps device memory bounded
            for rows, b, s in parts:
                ids, mask = bk.pad([inputs[r] for r in rows], b, s, self.cfg.pad_id)
                args = (ids, mask)
                if types is not None:
                    args += (bk.pad([types[r] for r in rows], b, s, 0)[0],)  # [b, s]
                pending.append(self._executable(b, s)(self.params, *args))  # [b, D]
            results = jax.device_get(pending)  # one transfer for the whole call
        for (rows, _, _), res in zip(parts, results):
            out[rows] = res[: len(rows)]
        return out
