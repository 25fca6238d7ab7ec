"""Sentence encoders on ONNX Runtime: the third encoder engine (`TENSORBUS_ENGINE=onnx`).

Why: ONNX Runtime's CPU kernels fuse a BERT block's small ops (LayerNorm, GELU, the
attention softmax) and multiply int8 weights, which neither eager torch nor the
JAX engine does; and a graph read from disk starts in well under a second.

What it computes is the torch engine's own math (engine/torch_encoder.py), traced
once, so the families, heads and refusals are the same by construction:
  1. `export`: `TorchEncoder`'s forward (embeddings, layers, pooling, Dense,
     Normalize) through the TorchScript exporter (`torch.onnx.export(dynamo=False)`):
     ids and mask [B, S] int64 in, both axes dynamic, [B, dim] float32 out. Pooling
     stays in the graph: pooling token states in numpy measured the same (within
     3 %, MiniLM, 64 x 16 and 64 x 128) and would copy every pooling mode's code.
  2. The file is kept in the worker's cache folder under a key of what decides its
     bytes (`graph_key`): the weight and config files' contents, the dtype, the
     opset, the torch / onnx / onnxruntime versions and this module's and the torch
     engine's code. A restart, or a second worker of the model, reads it back
     without loading torch or the weights (docs/decisions/0089).
  3. int8 (`TENSORBUS_QUANT=int8`): `onnxruntime.quantization.quantize_dynamic` on
     the MatMuls (QInt8 weights, one scale per output column: one scale per matrix
     measured 0.87 cosine on MiniLM), kept beside the float file. At build its
     vectors are compared with the float model's on `CHECK_TEXTS`; below
     `MIN_INT8_COSINE` the model is refused with the measured cosine
     (`UnsupportedEncoder`: the worker exits 78), never served approximately.
  4. One `InferenceSession` (all graph optimisations, CPU provider, intra-op threads
     = the cores this process may use, inter-op 1); inputs grouped by
     `buckets.plan` as the torch engine groups them, each group padded only to its
     longest input (the graph has no fixed shapes to pad to).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np

from engine import buckets as bk
from engine import prepared
from engine.dtypes import canonical_dtype
from engine.encoder.config import BertConfig, check_plain_bert, relative_buckets
from engine.encoder.spec import UnsupportedEncoder
from engine.weights import weight_files
from shared.logging import get_logger

if TYPE_CHECKING:
    import torch

    from engine.torch_encoder import TorchEncoder

log = get_logger(__name__)

QUANTS = ("none", "int8")  # "auto" reads as "none": an encoder's default is float
OPSET = 17  # the first with LayerNormalization as one op
FORMAT = 1  # bumped when the entry's layout changes
MIN_INT8_COSINE = 0.999  # the worst check text's cosine int8 vectors must reach
FLOAT_FILE, INT8_FILE, INT8_CHECK = "model.onnx", "model.int8.onnx", "int8-check.json"
# Modules whose code decides what the graph computes.
_CODE = ("engine/onnx_encoder.py", "engine/torch_encoder.py", "engine/encoder/spec.py",
         "engine/encoder/config.py")  # fmt: skip
_ROOT = Path(__file__).resolve().parent.parent
# JSON files in a model directory that say nothing about the graph (the tokenizer's).
_NOT_GRAPH = ("tokenizer", "special_tokens_map", "vocab", "added_tokens", "merges")

# What int8 vectors are checked on: short and long, several scripts, code, numbers.
CHECK_TEXTS = [
    "hi",
    "A man is eating food.",
    "The new movie is awesome!",
    "Nuclear fusion powers the sun, turning hydrogen into helium.",
    "¿Dónde está la estación de tren más cercana?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "naïve café résumé — accents, dashes and “quotes”",
    "e-mail me at someone@example.com or call +1 (555) 010-2030",
    "def add(a, b):\n    return a + b  # adds two numbers",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "3.14159 2.71828 1.41421 1729 65536 -40",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "The committee postponed its decision until the auditors had reviewed every "
    "invoice, which took the better part of a quarter and annoyed the suppliers.",
    " ".join(["river stone light garden music paper window table market summer forest "
              "bridge engine letter silver doctor"] * 16),  # fmt: skip
]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's
    cpuset narrows, not the host's count), at most NPROC where the orchestrator gave
    this worker its share of them (services/orchestrator/procs.py `thread_env`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = os.environ.get("NPROC", "")
    limit = int(share) if share.isdigit() and int(share) > 0 else None
    return max(1, min(cores or 1, limit or cores or 1))


def _versions() -> dict[str, str]:
    """Read from package metadata: a cached start imports neither torch nor onnx."""
    out = {}
    for name in ("torch", "onnx", "onnxruntime"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # e.g. onnxruntime-gpu: another name
            out[name] = ""
    return out


def graph_sources(model_dir: Path, cfg: BertConfig) -> list[Path]:
    """The files whose bytes decide the graph: the weights, each Dense layer's, and
    the model's JSON files other than the tokenizer's (config, modules, pooling)."""
    files = list(weight_files(model_dir))
    for layer in cfg.spec.dense:
        files += weight_files(model_dir / layer.path)
    files += sorted(p for p in model_dir.rglob("*.json") if not p.name.startswith(_NOT_GRAPH))
    return files


def graph_key(model_dir: Path, cfg: BertConfig, dtype: str, folder: Path) -> str:
    """The entry's name: what the exported bytes depend on, never the path or time
    (each file's SHA-256 is read once and remembered: `prepared.content_hash`)."""
    code = hashlib.sha256(b"".join((_ROOT / rel).read_bytes() for rel in _CODE)).hexdigest()
    files = [{"name": p.relative_to(model_dir).as_posix(), "size": p.stat().st_size,
              "sha256": prepared.content_hash(p, folder)} for p in graph_sources(model_dir, cfg)]
    doc = {"format": FORMAT, "dtype": dtype, "opset": OPSET, "code": code, "files": files,
           **_versions()}  # fmt: skip
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _graph_module(enc: TorchEncoder) -> torch.nn.Module:
    import torch
    import torch.nn.functional as F

    class Graph(torch.nn.Module):
        """`TorchEncoder.forward` with what tracing needs: LayerNorm's width is the
        constant hidden size (F.layer_norm takes no traced shape), and MPNet's bucket
        table is cut from one for the longest input (a bucket depends on i - j alone)
        instead of being computed in numpy for the traced length, which would fix S."""

        def __init__(self) -> None:
            super().__init__()
            found = [enc.word, enc.pos, *enc.emb_ln]
            for layer in enc.layers:
                for v in vars(layer).values():
                    found += list(v) if isinstance(v, tuple) else [v]
            found += [t for h in enc.head for t in h.values() if t is not None]
            found += [] if enc.rel_bias is None else [enc.rel_bias]
            # Buffers, so the exporter keeps them as named initializers: quantize_dynamic
            # finds a MatMul's weight only there (plain attributes trace to Constants).
            seen: set[int] = set()
            for t in found:
                if id(t) not in seen:
                    seen.add(id(t))
                    self.register_buffer(f"w{len(seen)}", t)
            if enc.rel_bias is not None:
                table = torch.from_numpy(relative_buckets(enc.max_tokens)).long()
                self.register_buffer("rel_buckets", table)  # [max_tokens, max_tokens]

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            eps, width = enc.cfg.eps, (enc.cfg.hidden,)

            def norm(x: torch.Tensor, gb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
                return F.layer_norm(x.float(), width, gb[0], gb[1], eps).to(x.dtype)

            x = norm(enc.word[ids] + enc.pos[: ids.shape[1]], enc.emb_ln)  # [B, S, D]
            keep: torch.Tensor = mask.bool()[:, None, None, :]  # [B, 1, 1, S]
            if enc.rel_bias is not None:
                s = ids.shape[1]
                table = cast(torch.Tensor, self.rel_buckets)[:s, :s]  # [S, S]
                rel = enc.rel_bias[table].permute(2, 0, 1)[None]  # [1, H, S, S]
                pad = torch.zeros_like(keep, dtype=torch.float32).masked_fill(~keep, float("-inf"))
                keep = (rel + pad).to(enc._dt)  # [B, H, S, S]
            for p in enc.layers:
                qkv = F.linear(x, p.qkv_w, p.qkv_b)
                x = norm(F.linear(enc._attention(qkv, keep), p.o_w, p.o_b) + x, p.ln1)
                y = F.linear(enc._act(F.linear(x, p.i_w, p.i_b)), p.f_w, p.f_b)
                x = norm(y + x, p.ln2)
            return enc._head(x, mask)

    return Graph().eval()


def export(model_dir: Path, dtype: str, path: Path) -> None:
    """Trace the torch engine's math for `model_dir` into the ONNX file `path`."""
    import torch

    from engine.torch_encoder import TorchEncoder

    enc = TorchEncoder(model_dir, dtype=dtype)
    s = min(8, enc.max_tokens)
    ids = torch.full((2, s), 5, dtype=torch.long)
    mask = torch.ones_like(ids)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "vectors": {0: "batch"}}  # fmt: skip
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer notes
        torch.onnx.export(_graph_module(enc), (ids, mask), str(path), dynamo=False,
                          input_names=["input_ids", "attention_mask"], output_names=["vectors"],
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True)  # fmt: skip


def quantize(src: Path, dst: Path) -> None:
    """int8 MatMul weights, one scale per output column; activations quantized per
    call (dynamic quantization: nothing to calibrate)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"], per_channel=True)  # fmt: skip


def session(path: Path, threads: int) -> Any:
    """An `onnxruntime.InferenceSession` on the CPU with every graph optimisation."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


class OnnxEncoder:
    """`engine.interface.Encoder` on ONNX Runtime; the torch engine's constructor plus
    `quant` ("none" | "int8"), `cache_dir` (where exported graphs are kept; None: a
    temporary folder, nothing kept), `threads` (0: `usable_cores()`) and
    `min_int8_cosine` (the int8 check's bound)."""

    def __init__(
        self,
        model_dir: str | Path,
        name: str = "all-MiniLM-L6-v2",
        dtype: str = "float32",
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        seq_buckets: Sequence[int] = (16, 32, 64, 128, 256),
        max_batch: int = 64,
        quant: str = "none",
        cache_dir: str | Path | None = None,
        threads: int = 0,
        min_int8_cosine: float = MIN_INT8_COSINE,
    ) -> None:
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.cfg = BertConfig(model_dir)
        check_plain_bert(self.cfg)
        self.dtype = canonical_dtype(dtype)
        if self.dtype != "float32":
            raise UnsupportedEncoder(f"the onnx engine computes float32 (ONNX Runtime's CPU "
                                     f"kernels for {self.dtype} are few and slower): use "
                                     f"TENSORBUS_DTYPE=float32, or TENSORBUS_QUANT=int8")  # fmt: skip
        self.quant = "none" if quant == "auto" else quant
        if self.quant not in QUANTS:
            raise UnsupportedEncoder(f"the onnx engine keeps float or int8 weights, not "
                                     f"{quant!r}")  # fmt: skip
        self.name = name
        self.task = "embed"
        self.device = "cpu"
        self.devices = [self.device]
        self.dim = self.cfg.dim
        self.normalize = self.cfg.spec.normalize
        self.prompts = dict(self.cfg.spec.prompts)
        self.default_prompt_name = self.cfg.spec.default_prompt_name
        self.max_tokens = self.cfg.max_tokens
        self.batch_buckets = bk.parse(batch_buckets)
        seqs = tuple(s for s in bk.parse(seq_buckets) if s < self.max_tokens)
        self.seq_buckets = seqs + (self.max_tokens,)
        self.max_batch = min(int(max_batch), self.batch_buckets[-1])
        self.threads = int(threads) or usable_cores()
        self.min_int8_cosine = float(min_int8_cosine)
        self.int8_cosine: float | None = None  # the int8 check's worst cosine, when int8
        self._lock = threading.Lock()
        entry = self._float_entry(Path(cache_dir) if cache_dir else None)
        self.path = entry / FLOAT_FILE
        if self.quant == "int8":
            self.path = self._int8_file(entry)
        self.session = session(self.path, self.threads)
        log.info("onnx_encoder_loaded", model=name, form=self.quant, path=str(self.path),
                 threads=self.threads, seconds=round(time.perf_counter() - t0, 2))  # fmt: skip

    # --- the files

    def _float_entry(self, cache_dir: Path | None) -> Path:
        """The folder holding this model's float graph, exported first if need be."""
        folder = cache_dir or Path(tempfile.mkdtemp(prefix="tensorbus-onnx-"))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{folder} is not writable")
            key = graph_key(self.model_dir, self.cfg, self.dtype, folder)
        except OSError as exc:  # a read-only cache: exported again each start
            log.warning("onnx_encoder_cache_not_kept", path=str(folder), error=str(exc))
            folder = Path(tempfile.mkdtemp(prefix="tensorbus-onnx-"))
            key = graph_key(self.model_dir, self.cfg, self.dtype, folder)
        entry = folder / key
        if (entry / FLOAT_FILE).exists():
            log.info("onnx_encoder_cached", model=self.name, path=str(entry / FLOAT_FILE))
            return entry
        # A temporary folder renamed whole: a reader never sees half a graph, and of two
        # workers exporting at once the second keeps the first's.
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder))
        try:
            t0 = time.perf_counter()
            export(self.model_dir, self.dtype, tmp / FLOAT_FILE)
            size = (tmp / FLOAT_FILE).stat().st_size
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users' workers
            try:
                os.rename(tmp, entry)
            except OSError:  # another process made it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("onnx_encoder_exported", model=self.name, path=str(entry / FLOAT_FILE),
                     bytes=size, seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return entry

    def _int8_file(self, entry: Path) -> Path:
        """The int8 graph beside the float one, quantized first if need be, and its
        check against the float graph (read back when kept): refused below the bound."""
        path = entry / INT8_FILE
        if not path.exists():
            t0 = time.perf_counter()
            tmp = entry / f".{INT8_FILE}.{os.getpid()}.tmp"
            try:
                quantize(entry / FLOAT_FILE, tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            log.info("onnx_encoder_quantized", model=self.name, path=str(path),
                     bytes=path.stat().st_size, seconds=round(time.perf_counter() - t0, 2))
        check = entry / INT8_CHECK
        try:
            worst = float(json.loads(check.read_text())["min_cosine"])
        except (OSError, ValueError, KeyError):
            worst = self._check_int8(entry / FLOAT_FILE, path)
            try:
                check.write_text(json.dumps({"min_cosine": worst, "texts": len(CHECK_TEXTS)}))
            except OSError as exc:
                log.warning("onnx_encoder_check_not_kept", path=str(check), error=str(exc))
        self.int8_cosine = worst
        log.info("onnx_encoder_int8_checked", model=self.name, min_cosine=round(worst, 6),
                 bound=self.min_int8_cosine)  # fmt: skip
        if worst < self.min_int8_cosine:
            raise UnsupportedEncoder(f"int8 weights (ONNX Runtime's dynamic quantization) give "
                                     f"vectors at cosine {worst:.4f} to float32's on the check "
                                     f"texts, below {self.min_int8_cosine}: serve it with "
                                     f"TENSORBUS_QUANT=none")  # fmt: skip
        return path

    def _check_int8(self, float_path: Path, int8_path: Path) -> float:
        """The worst cosine between int8 and float vectors of `CHECK_TEXTS`."""
        from engine.tokenizer import Tokenizer, has_tokenizer

        if not has_tokenizer(self.model_dir):
            raise UnsupportedEncoder("int8 is checked against float32 on texts, and this "
                                     "model has no tokenizer file to encode them")  # fmt: skip
        cut = self.max_tokens
        ids = [x if len(x) <= cut else x[: cut - 1] + x[-1:]
               for x in Tokenizer.from_dir(self.model_dir).encode_batch(CHECK_TEXTS)]  # fmt: skip
        want = self._run(session(float_path, self.threads), ids)
        got = self._run(session(int8_path, self.threads), ids)
        return float(_cosines(got, want).min())

    # --- the engine

    def close(self, wait_s: float = 0.0) -> bool:
        return True  # nothing compiles in the background

    def program_counts(self) -> tuple[int, int]:
        return 0, 0  # the graph was optimised when the session was made

    def warmup(self, progress: bool = True) -> int:
        """One forward per sequence bucket (thread pool and ONNX Runtime's memory
        arena warm); nothing is compiled, so the count is 0."""
        from tqdm import tqdm

        for s in tqdm(self.seq_buckets, desc=f"warm {self.name}", disable=not progress,
                      leave=False):  # fmt: skip
            self._run(self.session, [[self.cfg.pad_id] * s])
        return 0

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        return self._run(self.session, inputs)

    def _run(self, sess: Any, inputs: list[list[int]]) -> np.ndarray:
        """[len(inputs), dim] float32 from `sess`, in groups as the torch engine's."""
        out = np.empty((len(inputs), self.dim), dtype=np.float32)  # [N, D]
        if not inputs:
            return out
        lengths = [len(x) for x in inputs]
        bk.check_lengths(lengths, self.max_tokens)
        groups = bk.plan(lengths, self.batch_buckets, self.seq_buckets, self.max_batch)
        with self._lock:
            for rows, _, _ in groups:
                seqs = [inputs[r] for r in rows]
                ids, mask = bk.pad(seqs, len(seqs), max(len(x) for x in seqs), self.cfg.pad_id)
                feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
                out[rows] = sess.run(None, feed)[0]
        return out
