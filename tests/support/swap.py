"""Helpers for the hot-swap tests (tests/integration/test_hot_swap.py).

Encoders: tiny pushed model directories served by a mock engine whose vectors carry
the version that computed them (last component), so a reply's claimed version (the
`Tensorbus-Model-Version` header) is checked against the engine that actually ran.
Decoders: tiny GPT-2 versions with different weights, and what each produces
greedily (transformers, computed before any service runs), so a stream's claimed
version is checked against its text.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from safetensors.numpy import save_file

from services.gateway.codec import VERSION_HEADER
from shared import catalog, subjects
from shared.errors import HEADER_CODE
from shared.telemetry import RequestRecord, record_decoder
from bench.support.mock_encoder import MockEncoder

# The bundled encoder's tokenizer and config, with tiny fake weights: what the gateway
# needs to tokenize, and a directory the registry accepts as an encoder.
ENCODER_FILES = ["config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "sentence_bert_config.json", "modules.json",
                 "1_Pooling/config.json"]


def model_name() -> str:
    return f"swap-{uuid.uuid4().hex[:8]}"


def encoder_dir(root: Path, seed: int) -> Path:
    src = catalog.bundled_dir(catalog.ENCODER)
    for rel in ENCODER_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    w = np.random.default_rng(seed).standard_normal((16, 16)).astype(np.float32)
    save_file({"w": w}, str(root / "model.safetensors"))
    return root


def decoder_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "max_position_embeddings": 128}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.ones((4, 4), np.float32)}, str(root / "model.safetensors"))
    return root


class TaggedEncoder(MockEncoder):
    """The mock encoder with its version in the last component of every vector."""

    def __init__(self, name: str, version: str) -> None:
        super().__init__(name=name, dim=8)
        self.version = version
        self.warmed = 0
        self.warming = threading.Event()  # set when its warm-up starts
        self.warm_gate = threading.Event()  # cleared: warm-up waits for the test
        self.warm_gate.set()

    def warmup(self, progress: bool = True) -> int:
        self.warming.set()
        self.warm_gate.wait()
        self.warmed += 1
        return 0

    def embed(self, inputs):
        out = super().embed(inputs)  # [N, 8]
        out[:, -1] = float(self.version)
        return out


@dataclass
class Built:
    """What the engine factory made, in order: a test can reach into any version."""

    engines: dict[str, TaggedEncoder] = field(default_factory=dict)
    hold_warmup: set[str] = field(default_factory=set)  # these wait on their warm_gate

    def __call__(self, info: catalog.ModelInfo, version: str) -> TaggedEncoder:
        engine = TaggedEncoder(info.name, version)
        if version in self.hold_warmup:
            engine.warm_gate.clear()
        self.engines[version] = engine
        return engine


async def push_versions(reg, tmp_path: Path, name: str, n: int) -> None:
    for i in range(1, n + 1):
        await reg.push(encoder_dir(tmp_path / f"v{i}", seed=i), name, version=str(i),
                       progress=False)


@dataclass
class Reply:
    client: int
    sent: float  # monotonic, when the request went out
    got: float  # monotonic, when its reply came back
    code: int
    version: str  # what the reply says (header)
    computed: str  # what the vector says (the engine that ran)


async def embed(nc, model: str, text: str = "hello world", client: int = 0,
                timeout: float = 10.0) -> Reply:
    sent = time.monotonic()
    msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(
        {"model": model, "input": [text]}), timeout=timeout)
    headers = msg.headers or {}
    code = int(headers.get(HEADER_CODE, 200))
    computed = ""
    if code == 200:
        vec = msgspec.json.decode(msg.data)["data"][0]["embedding"]
        computed = str(int(vec[-1]))
    return Reply(client, sent, time.monotonic(), code, headers.get(VERSION_HEADER, ""), computed)


async def _embed_request(nc, model: str, client: int, i: int) -> Reply:
    return await embed(nc, model, f"client {client} request {i}", client)


class Load:
    """`clients` closed loops sending requests until stopped; every outcome is kept."""

    def __init__(self, nc, model: str, clients: int = 8, ask=None) -> None:
        self.nc, self.model, self.clients = nc, model, clients
        self.ask = ask or _embed_request  # (nc, model, client, i) -> a Reply or a Streamed
        self.replies: list = []
        self.dropped: list[BaseException] = []  # timeouts and transport errors
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._tick = asyncio.Condition()

    async def __aenter__(self) -> "Load":
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _loop(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.replies.append(await self.ask(self.nc, self.model, client, i))
            except Exception as exc:  # noqa: BLE001 - counted, asserted on
                self.dropped.append(exc)
            i += 1
            async with self._tick:
                self._tick.notify_all()

    async def until(self, cond, timeout: float = 30.0) -> None:
        async with self._tick:
            await asyncio.wait_for(self._tick.wait_for(lambda: cond(self.replies)), timeout)

    def count(self, version: str) -> int:
        return sum(r.version == version for r in self.replies)


def assert_all_served(load: Load) -> None:
    assert load.dropped == []
    assert [r for r in load.replies if r.code != 200] == []
    assert all(r.version == r.computed for r in load.replies)


async def collect_records(nc) -> tuple[list[RequestRecord], object]:
    """Every telemetry request record from now on (and the subscription, to end it)."""
    records: list[RequestRecord] = []

    async def on_record(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord):
            records.append(rec)

    sub = await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
    await nc.flush()
    return records, sub


def hb(st, worker_id: str):
    return st.scheduler.fleet.workers[worker_id].hb


# ------------------------------------------------------------------ decoders
DEC_CONTEXT = 64
DEC_PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 112)), [7, 8, 9, 10, 11]]
DEC_NEW = 12  # tokens per stream


@dataclass
class DecoderVersions:
    """Tiny GPT-2 directories, one per version, and each version's greedy text."""

    dirs: dict[str, Path]
    texts: dict[str, list[str]]  # version -> per prompt of DEC_PROMPTS

    def version_of(self, prompt: int, text: str) -> str | None:
        """Which version's greedy output `text` is ("" when none's)."""
        return next((v for v, t in self.texts.items() if t[prompt] == text), "")


def decoder_versions(root: Path, n: int) -> DecoderVersions:
    """Versions "1".."n" of a tiny GPT-2, other weights each (seed = version)."""
    from engine.tokenizer import Tokenizer
    from tests.support.tiny_models import build, hf_greedy

    dirs, texts = {}, {}
    for i in range(1, n + 1):
        v = str(i)
        dirs[v] = root / f"gpt2-v{v}"
        model = build("gpt2", dirs[v], positions=DEC_CONTEXT, seed=i)
        tok = Tokenizer.from_dir(dirs[v])
        eos = set(tok.eos_token_ids)
        texts[v] = []
        for prompt in DEC_PROMPTS:
            ids = hf_greedy(model, prompt, DEC_NEW)
            cut = next((k for k, t in enumerate(ids) if t in eos), len(ids))
            texts[v].append(tok.decode(ids[:cut]))
    for k in range(len(DEC_PROMPTS)):  # a mislabelled or mixed stream must show
        assert len({texts[v][k] for v in texts}) == n, [texts[v][k] for v in texts]
    return DecoderVersions(dirs, texts)


@dataclass
class Decoders:
    """Engine factory for a registry worker: a DecoderEngine per version it loads,
    remembered weakly so a test can tell when the worker has let go of one."""

    slots: int = 4
    built: dict[str, list[weakref.ref]] = field(default_factory=dict)

    def __call__(self, info: catalog.ModelInfo, version: str):
        from engine.decoder import DecoderEngine

        engine = DecoderEngine(info.path, name=info.name, slots=self.slots,
                               max_context=DEC_CONTEXT, prefill_buckets=(16,))
        self.built.setdefault(version, []).append(weakref.ref(engine))
        return engine

    def alive(self, version: str) -> int:
        gc.collect()
        return sum(r() is not None for r in self.built.get(version, []))


@dataclass
class Streamed:
    """One streamed completion over NATS, as its client saw it."""

    client: int
    prompt: int  # index into DEC_PROMPTS
    sent: float  # monotonic
    got: float  # monotonic, [DONE] received
    headers: list[str]  # Tensorbus-Model-Version of each chunk message ("" if none)
    text: str
    error: str = ""  # the error code, if the stream ended in one
    done_header: str = ""  # the version header on [DONE]

    @property
    def version(self) -> str:
        return self.headers[0] if self.headers else ""


async def stream_completion(nc, model: str, prompt: int, client: int = 0,
                            timeout: float = 30.0) -> Streamed:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    sent = time.monotonic()
    await nc.publish(subjects.COMPLETIONS, msgspec.json.encode({
        "model": model, "prompt": DEC_PROMPTS[prompt], "max_tokens": DEC_NEW,
        "temperature": 0, "stream": True}), reply=inbox)
    headers, pieces, error = [], [], ""
    try:
        while True:
            msg = await sub.next_msg(timeout=timeout)
            hdrs = msg.headers or {}
            if msg.data == b"[DONE]":
                break
            if HEADER_CODE in hdrs:
                error = hdrs[HEADER_CODE]
                continue
            headers.append(hdrs.get(VERSION_HEADER, ""))
            choices = msgspec.json.decode(msg.data)["choices"]
            pieces += [c["text"] for c in choices]
    finally:
        await sub.unsubscribe()
    return Streamed(client, prompt, sent, time.monotonic(), headers, "".join(pieces), error,
                    hdrs.get(VERSION_HEADER, ""))


async def stream_request(nc, model: str, client: int, i: int) -> Streamed:
    """A Load's request: client c's i-th stream cycles through the prompts."""
    return await stream_completion(nc, model, (client + i) % len(DEC_PROMPTS), client)


def assert_streams_whole(load, versions: DecoderVersions) -> None:
    """No stream failed; each came from one version, the one its headers name."""
    assert load.dropped == []
    assert [s for s in load.replies if s.error] == []
    for s in load.replies:
        assert set(s.headers) == {s.version} and s.done_header == s.version, s
        assert s.text == versions.texts[s.version][s.prompt], (s, versions.version_of(s.prompt, s.text))
