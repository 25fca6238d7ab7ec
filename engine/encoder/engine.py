"""The encoder engine: what a worker calls, `engine.interface.Encoder` (and, for a
cross-encoder, `Reranker`) over one jitted forward and a few compiled shapes.

Two layouts. BERT, RoBERTa / XLM-R and MPNet pack (engine/encoder/packing.py): a
call's inputs are placed back to back into rows, and the programs are a ladder of
token counts (8 for MiniLM); each group is laid out as ids, slot and position
[rows, width] and runs `forward_packed`, whose [slots, D] outputs are written into
the inputs' order. ModernBERT and decoder-based embedders, whose attention is their
own, keep the padded grid below (and `layout="grid"` forces it, for comparison).

Dataflow of one grid `EncoderEngine.embed` (or `score`) call:
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

Compiles (`compile_ahead`): "all" compiles every program at `warmup`; "first"
compiles the few any call can be served from (packed: the smallest, one row of the
limit and the full-size ones; grid: one input at every length) and the shapes of the
worker's warm-up timing, and the rest on a background thread (engine/programs.py),
so a worker is ready in a few programs' time instead of all of them; while those
compile, a call runs on the compiled ones. "lazy" compiles each where first needed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np

from engine import buckets as bk
from engine import jaxrt, sharding
from engine.encoder import packing
from engine.encoder.config import BertConfig
from engine.encoder.model import (activate, decoder_forward, forward, forward_packed,
                                  score_forward, score_packed)
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
PACKED_FAMILIES = ("bert", "roberta", "mpnet")  # their attention is plain: they pack
LAYOUTS = ("auto", "packed", "grid")


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
        layout: str = "auto",
    ) -> None:
        """compile_ahead: what `warmup` compiles before it returns: "all", "first" (a
        first set, the rest on a background thread) or "lazy" (each where first
        needed). layout: "packed" (the default where the family allows it), "grid"
        (`batch_buckets` x `seq_buckets`, what the other families use)."""
        if compile_ahead not in COMPILE_AHEAD:
            raise ValueError(f"compile_ahead {compile_ahead!r}: use one of {', '.join(COMPILE_AHEAD)}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        self.compile_ahead = compile_ahead
        self.cfg = BertConfig(model_dir)
        packs = self.cfg.family in PACKED_FAMILIES
        if layout == "packed" and not packs:
            raise ValueError(f"{self.cfg.family} encoders do not pack (layout 'grid')")
        self.packed = packs and layout != "grid"
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
        # The packed programs (a ladder of token counts), used when `packed`.
        self.ladder = packing.ladder(self.max_tokens, token_budget, int(max_batch))
        if self.packed:
            self.max_batch = int(max_batch)
        self.params = load_params(model_dir, self.dtype, self.quant, self._mesh)
        self.weight_bytes = tree_bytes(self.params)  # integers and scales when quantized
        self.traces = 0  # times `forward` was traced: one per bucket, at compile
        self.task = self.cfg.spec.task  # "embed", or "score" for a cross-encoder
        if self.packed:
            fn = self._trace_packed if self.task == "embed" else self._trace_score_packed
            self._jitted = jax.jit(fn, static_argnames=("slots",))
        else:
            self._jitted = jax.jit(self._trace if self.task == "embed" else self._trace_score)
        self.programs: Programs[packing.Shape | tuple[int, int]] = Programs(name)
        self._lock = threading.Lock()

    def _trace(self, params: Params, ids, mask):
        self.traces += 1  # runs at trace time only, never per call
        if self.cfg.family == "decoder":
            return decoder_forward(params, ids, mask, self.cfg)
        return forward(params, ids, mask, self.cfg, self.tp)

    def _trace_score(self, params: Params, ids, mask, types):
        self.traces += 1
        return score_forward(params, ids, mask, types, self.cfg, self.tp)

    def _trace_packed(self, params: Params, ids, slot, pos, *, slots: int):
        self.traces += 1
        return forward_packed(params, ids, slot, pos, self.cfg, self.tp, slots=slots)

    def _trace_score_packed(self, params: Params, ids, slot, pos, types, *, slots: int):
        self.traces += 1
        return score_packed(params, ids, slot, pos, types, self.cfg, self.tp, slots=slots)

    @property
    def shapes(self) -> list:
        """Every program this engine serves: packing.Shape, or grid (batch, seq)."""
        if self.packed:
            return list(self.ladder)
        return bk.shapes(self.batch_buckets, self.seq_buckets)

    def compiled_count(self) -> int:
        """Executables held: one per program once warm, never more."""
        return self.programs.compiled

    def program_counts(self) -> tuple[int, int]:
        return self.programs.compiled, len(self.shapes)

    def first_shapes(self) -> list:
        """What `compile_ahead="first"` compiles before ready: one input at every
        length (any request is served from these, in parts), and the groups of the
        worker's warm-up timing (full batches of short and of longer inputs). Packed:
        the smallest program (one short query), one row of the limit (holds any
        input) and the full-size ones (full batches of short and of long inputs)."""
        if self.packed:
            row = next(s for s in self.ladder if s.width == self.max_tokens)
            top = max(s.tokens for s in self.ladder)
            full = [s for s in self.ladder if s.tokens == top]  # a full batch's, each width
            return list(dict.fromkeys([self.ladder[0], row, *full]))
        first = [(self.batch_buckets[0], s) for s in self.seq_buckets]
        for n in TIMED_BATCH_TOKENS:
            n = min(n, self.max_tokens)
            for _, b, s in bk.plan([n] * self.max_batch, self.batch_buckets, self.seq_buckets,
                                   self.max_batch, self.token_budget):  # fmt: skip
                if (b, s) not in first:
                    first.append((b, s))
        return first

    def _lowering(self, key):
        """A function that lowers the forward of one program (not called here).

        Ahead-of-time `lower().compile()` rather than a first call: warm-up compiles
        a program without running it (running 64x256 alone is seconds of CPU)."""
        # Grid: ids and mask [B, S]; packed: ids, slot, pos [R, W]; then a pair's token
        # types. Replicated over the devices when split.
        rep = None if self._mesh is None else sharding.replicated(self._mesh)
        dims, n = ((key.rows, key.width), 3) if self.packed else (key, 2)
        spec = jax.ShapeDtypeStruct(dims, jnp.int32, sharding=rep)
        args = (spec,) * (n if self.task == "embed" else n + 1)
        kw = {"slots": key.slots} if self.packed else {}
        return lambda: self._jitted.lower(self.params, *args, **kw)

    def _executable(self, key):
        """The compiled forward of one program; compiled here if nobody has."""
        return self.programs.get(key, self._lowering(key))

    @staticmethod
    def _size(key) -> int:
        return key.tokens if isinstance(key, packing.Shape) else key[0] * key[1]

    @staticmethod
    def _label(key) -> str:
        return key.name if isinstance(key, packing.Shape) else f"{key[0]}x{key[1]}"

    def warmup(self, progress: bool = True) -> int:
        """Compile what `compile_ahead` says; return how many programs were compiled
        before it returned."""
        from tqdm import tqdm

        shapes = {"all": self.shapes, "first": self.first_shapes(), "lazy": []}[self.compile_ahead]
        bar = tqdm(total=len(shapes), desc=f"compile {self.name}", disable=not progress,
                   leave=False)  # fmt: skip

        def compiled(key) -> None:
            bar.set_postfix_str(self._label(key))
            bar.update()

        with self._lock:
            self.programs.compile_together([(k, self._lowering(k)) for k in shapes], compiled)
        bar.close()
        if self.compile_ahead == "first":
            rest = sorted((k for k in self.shapes if k not in shapes), key=self._size)
            self.programs.start_background([(k, self._lowering(k)) for k in rest])
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
        grids = cast("list[tuple[int, int]]", self.programs.keys())  # unpacked: (B, S) only
        done = [k for k in grids if k[1] >= s]
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

    def score(self, inputs: list[list[int]], token_types: list[list[int]],
              raw: bool = False) -> np.ndarray:
        """A cross-encoder's scores: [len(inputs), num_labels] float32, after the
        model's activation (CrossEncoder.predict's), or with `raw` the logits before
        it (one program computes the logits; `activate` is the host's). Each input is
        one text pair as its tokenizer encodes it (`[CLS] a [SEP] b [SEP]`,
        `<s> a </s></s> b </s>`), with the pair's token type ids (all 0 for
        RoBERTa-style models)."""
        if self.task != "score":
            raise ValueError(f"{self.name} embeds texts; scoring pairs needs a cross-encoder")
        if [len(x) for x in inputs] != [len(t) for t in token_types]:
            raise ValueError("each input needs one token type per token")
        logits = self._run(inputs, token_types)
        return logits if raw else self.activate(logits)

    def activate(self, logits: np.ndarray) -> np.ndarray:
        """`score(raw=True)`'s logits -> the model's activated scores."""
        return activate(logits, self.cfg)

    def _run(self, inputs: list[list[int]], types: list[list[int]] | None) -> np.ndarray:
        out = np.empty((len(inputs), self.dim), dtype=np.float32)  # [N, D]
        if not inputs:
            return out
        lengths = [len(x) for x in inputs]
        bk.check_lengths(lengths, self.max_tokens)
        if self.packed:
            return self._run_packed(inputs, types, lengths, out)
        groups = bk.plan(lengths, self.batch_buckets, self.seq_buckets, self.max_batch,
                         self.token_budget)
        pending = []
        parts = [p for rows, b, s in groups for p in self._parts(rows, b, s)]
        with self._lock:  # one caller at a time keeps device memory bounded
            for rows, b, s in parts:
                ids, mask = bk.pad([inputs[r] for r in rows], b, s, self.cfg.pad_id)
                args: tuple[np.ndarray, ...] = (ids, mask)
                if types is not None:
                    args += (bk.pad([types[r] for r in rows], b, s, 0)[0],)  # [b, s]
                pending.append(self._executable((b, s))(self.params, *args))  # [b, D]
            results = jax.device_get(pending)  # one transfer for the whole call
        for (rows, _, _), res in zip(parts, results):
            out[rows] = res[: len(rows)]
        return out

    def _ready_shapes(self, longest: int) -> list[packing.Shape]:
        """The programs a call may use: all once compiled; while the rest compile in
        the background, the compiled ones (if one holds the longest input)."""
        if not self.programs.compiling:
            return list(self.ladder)
        done = [k for k in self.ladder if self.programs.has(k)]
        return done if done and max(k.width for k in done) >= longest else list(self.ladder)

    def _run_packed(self, inputs, types, lengths: list[int], out: np.ndarray) -> np.ndarray:
        groups = packing.plan(lengths, self._ready_shapes(max(lengths)))
        pending = []
        with self._lock:  # one caller at a time keeps device memory bounded
            for g in groups:
                args = g.arrays(inputs, self.cfg.pad_id)  # ids, slot, pos: [R, W]
                if types is not None:
                    args += (g.place(types),)
                pending.append(self._executable(g.shape)(self.params, *args))  # [slots, D]
            results = jax.device_get(pending)  # one transfer for the whole call
        for g, res in zip(groups, results):
            out[g.index] = res[: len(g.index)]
        return out
