"""What the gateway knows about each model: its tokenizer, its limits, who serves it.

Model names may pin a version: `NAME@VERSION`. The catalogue (and, when present, the
registry) says which names exist; heartbeats say which are served and ready; the
schedulers' scale decisions name every model they know (the registry's included, at
zero workers too) and whether a worker is wanted; the orchestrator's FleetStatus says
which failed. A model card's `state` comes from all four. A name
the catalogue lacks is looked up in the registry per request
(`services.gateway.versions`): the version the request will run on, whose tokenizer
files alone (never its weights) are fetched, verified, into the gateway's cache.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, TypedDict

from services.fleet import Fleet
from shared import catalog
from shared.api_models import ModelCard
from shared.errors import bad_request, not_found
from shared.logging import get_logger

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

log = get_logger("gateway.models")


@dataclass
class ModelEntry:
    info: catalog.ModelInfo
    tokenizer: Tokenizer  # no tensors
    prefix: list[int]  # special tokens around raw token-id input
    suffix: list[int]
    created: int
    task: str = ""  # encoders: "embed", or "score" for a cross-encoder (reranker)
    labels: int = 0  # a cross-encoder's scores per pair
    prompts: dict[str, str] = field(default_factory=dict)  # encoders: name -> prefix text
    default_prompt: str | None = None  # encoders: the prompt a request naming none gets
    dim: int = 0  # encoders: the width of their vectors (0: unknown)
    normalized: bool = True  # encoders: their vectors are L2-normalised (a Normalize module)


def split_name(model: str) -> tuple[str, str]:
    name, _, version = model.partition("@")
    if not name or (_ and not version):
        raise bad_request(f"bad model name '{model}': use NAME or NAME@VERSION")  # no repr
    return name, version


@dataclass(frozen=True)
class Resolved:
    """A resolver's answer for one request."""

    info: catalog.ModelInfo  # its directory holds the tokenizer, chat template and configs
    version: str = ""  # the registry version `info` is of; "" = one for every version
    pin: str = ""  # the version the work names; "" = the scheduler draws (prod or canary)


# A resolver maps (name, version the client pinned or "", user key) to a Resolved (or a
# bare ModelInfo, meaning one tokenizer for every version), or None for no such model.
Resolver = Callable[..., Awaitable["Resolved | catalog.ModelInfo | None"]]


async def catalogue_resolver(name: str, version: str = "",
                             user: str = "") -> catalog.ModelInfo | None:
    return catalog.resolve(name)


class ModelTable:
    """Model entries (tokenizer, limits) by (name, version): a name the resolver
    answers with one entry for every version (the catalogue's) is resolved once;
    registry names are resolved per request (`services.gateway.versions`), so a
    promoted or canary version is tokenized with its own files."""

    def __init__(self, fleet: Fleet, resolver: Resolver = catalogue_resolver) -> None:
        self.fleet = fleet
        self.resolver = resolver
        self._static: dict[str, ModelEntry] = {}  # names with one entry for every version
        self._entries: dict[tuple[str, str], ModelEntry] = {}
        self._latest: dict[str, ModelEntry] = {}  # per name, the last entry used (cards)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def get(self, name: str) -> ModelEntry:
        """The entry an unpinned request of `name` would be tokenized with."""
        return (await self.choose(name))[0]

    async def choose(self, name: str, version: str = "", user: str = "") -> tuple[ModelEntry, str]:
        """One request's entry, and the version its work names (`version` as the client
        pinned it, or the one the registry resolver chose for its tokenizer)."""
        entry = self._static.get(name)
        if entry is not None:
            return entry, version
        res = await self.resolver(name, version, user)
        if res is None:
            raise not_found(f"the model '{name}' does not exist")
        if isinstance(res, catalog.ModelInfo):
            res = Resolved(res, "", version)
        key = (name, res.version)
        entry = self._entries.get(key)
        if entry is None:
            async with self._locks.setdefault(key, asyncio.Lock()):
                entry = self._entries.get(key)
                if entry is None:
                    entry = await asyncio.to_thread(_load_entry, res.info)
                    self._entries[key] = entry
        if not res.version:
            self._static[name] = entry
        self._latest[name] = entry
        return entry, res.pin

    async def stop(self) -> None:
        stop = getattr(self.resolver, "stop", None)  # the registry resolver's alias watches
        if stop is not None:
            await stop()

    @staticmethod
    def _bundled() -> tuple[str, ...]:
        return tuple(_bundled_infos())

    def known(self) -> list[str]:
        names = set(self._bundled()) | set(self._latest) | set(self.fleet.models())
        return sorted(names)

    def card(self, name: str, decisions, status=None) -> ModelCard:
        """`name`'s card: `decisions` a shared.scaling.LiveDecisions, `status` the
        orchestrator's ModelStatus (or None)."""
        workers = self.fleet.for_model(name)
        ready = [w for w in workers if w.ready]
        if status is not None and status.state == "failed":
            state = "failed"
        elif ready:
            state = "ready"
        elif (self.fleet.warming(name) or decisions.desired(name) > 0
              or (status is not None and status.state == "starting")):
            state = "starting"
        else:
            state = "scaled_to_zero"
        entry = self._latest.get(name)
        kind = (entry.info.kind if entry else "") or next((w.hb.kind for w in workers), "") \
            or decisions.kind(name) or _bundled_kind(name)
        info = entry.info if entry else _bundled_infos().get(name)
        return ModelCard(id=name, created=entry.created if entry else int(time.time()),
                         max_model_len=info.max_tokens if info else None, kind=kind,
                         versions=sorted({v for w in ready for v in w.hb.versions}),
                         ready_workers=len(ready), state=state,
                         programs_compiled=sum(w.hb.programs_compiled for w in workers),
                         programs_total=sum(w.hb.programs_total for w in workers),
                         forms_measured=sum(w.hb.forms_measured for w in workers),
                         forms_total=sum(w.hb.forms_total for w in workers),
                         quant=ready[0].hb.quant if ready else "",
                         compute_forms=dict(ready[0].hb.compute_forms) if ready else {},
                         **_speculation(workers),
                         reason=status.reason if state == "failed" and status else "")


class _Speculation(TypedDict):
    spec_decode_acceptance: float
    spec_decode_tokens_per_step: float


def _speculation(workers) -> _Speculation:
    """The model card's speculative decoding figures over `workers`' heartbeats."""
    drafts = sum(w.hb.spec_decode_drafts for w in workers)
    drafted = sum(w.hb.spec_decode_draft_tokens for w in workers)
    accepted = sum(w.hb.spec_decode_accepted_tokens for w in workers)
    return {"spec_decode_acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_decode_tokens_per_step": round((accepted + drafts) / drafts, 4) if drafts
            else 0.0}


@functools.cache
def _bundled_infos() -> dict[str, catalog.ModelInfo]:
    """The bundled models: installed packages, fixed for the process's life (read once:
    describing them parses a GGUF header, and /v1/models is polled)."""
    return {i.name: i for i in catalog.bundled()}


def _bundled_kind(name: str) -> str:
    info = catalog.resolve(name)
    return info.kind if info is not None else ""


def _load_entry(info: catalog.ModelInfo) -> ModelEntry:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(info.path))
    specials = tok.encode_batch([""])[0]
    prefix, suffix = (specials[:1], specials[1:]) if len(specials) >= 2 else (specials, [])
    if info.kind != "encoder":
        return ModelEntry(info, tok, list(prefix), list(suffix), int(time.time()))
    cfg = _encoder_config(info)
    if cfg is None:  # its workers exit 78 with the reason, the card says `failed`
        return ModelEntry(info, tok, list(prefix), list(suffix), int(time.time()), "embed")
    spec = cfg.spec
    return ModelEntry(info, tok, list(prefix), list(suffix), int(time.time()), spec.task,
                      spec.num_labels, dict(spec.prompts), spec.default_prompt_name, cfg.dim,
                      spec.normalize)


def _encoder_config(info: catalog.ModelInfo):
    """An encoder's config and spec from its files alone (pure Python, no weights
    read): task, labels, prompts and width; None for a model the encoder engines
    refuse (it reads as an embedder without prompts)."""
    from engine.encoder.config import BertConfig

    try:
        return BertConfig(info.path)
    except (ValueError, KeyError) as exc:
        log.warning("model_spec_unreadable", model=info.name, error=str(exc))
        return None
