"""What the gateway knows about each model: its tokenizer, its limits, who serves it.

Model names may pin a version: `NAME@VERSION`. The catalogue (and, when present, the
registry) says which names exist; heartbeats say which are served and ready; the
schedulers' scale decisions name every model they know (the registry's included, at
zero workers too) and whether a worker is wanted; the orchestrator's FleetStatus says
which failed. A model card's `state` comes from all four. A name
the catalogue lacks is looked up in the registry: a version that ready workers serve
(else prod, else an earlier prod) is fetched, verified, into the gateway's cache for
the tokenizer and limits.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from services.fleet import Fleet
from shared import catalog
from shared.api import ModelCard
from shared.errors import bad_request, not_found
from shared.logging import get_logger

log = get_logger("gateway.models")


@dataclass
class ModelEntry:
    info: catalog.ModelInfo
    tokenizer: object  # engine.tokenizer.Tokenizer (no tensors)
    prefix: list[int]  # special tokens around raw token-id input
    suffix: list[int]
    created: int
    task: str = ""  # encoders: "embed", or "score" for a cross-encoder (reranker)
    labels: int = 0  # a cross-encoder's scores per pair
    prompts: dict[str, str] = field(default_factory=dict)  # encoders: name -> prefix text
    default_prompt: str | None = None  # encoders: the prompt a request naming none gets
    dim: int = 0  # encoders: the width of their vectors (0: unknown)


def split_name(model: str) -> tuple[str, str]:
    name, _, version = model.partition("@")
    if not name or (_ and not version):
        raise bad_request(f"bad model name '{model}': use NAME or NAME@VERSION")  # no repr
    return name, version


# A resolver returns the directory holding a model's tokenizer and config, or None.
Resolver = Callable[[str], Awaitable["catalog.ModelInfo | None"]]


async def catalogue_resolver(name: str) -> catalog.ModelInfo | None:
    return catalog.resolve(name)


def registry_resolver(registry, cache_dir: str | Path, fleet: Fleet | None = None,
                      fallback: Resolver = catalogue_resolver) -> Resolver:
    """`fallback` first (the catalogue: no download), else a version from the registry.

    The candidates, in order: versions ready workers serve (what requests will run on),
    prod, earlier prods. A version that cannot be fetched (missing, corrupted) is
    skipped. Versions of one name are expected to share a tokenizer: the first one
    resolved tokenizes every version of that name for the life of the gateway."""
    from services.registry.errors import RegistryError
    from services.registry.source import ModelSource

    source = ModelSource(registry, Path(cache_dir))

    async def resolve(name: str) -> catalog.ModelInfo | None:
        info = await fallback(name)
        if info is not None or registry is None:
            return info
        try:
            aliases = await registry.aliases(name)
        except RegistryError as exc:
            log.warning("model_unresolved", model=name, error=str(exc))
            return None
        served = [v for w in (fleet.ready(name) if fleet else []) for v in w.hb.versions]
        for version in dict.fromkeys(served + [aliases.prod] + aliases.previous[::-1]):
            if not version:
                continue
            try:
                _, path = await source.resolve(name, version)
            except RegistryError as exc:
                log.warning("model_version_unusable", model=name, version=version,
                            error=str(exc))
                continue
            log.info("model_from_registry", model=name, version=version)
            return catalog.describe(name, path)
        return None

    return resolve


class ModelTable:
    def __init__(self, fleet: Fleet, resolver: Resolver = catalogue_resolver) -> None:
        self.fleet = fleet
        self.resolver = resolver
        self._entries: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, name: str) -> ModelEntry:
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self._entries:
                return self._entries[name]
            info = await self.resolver(name)
            if info is None:
                raise not_found(f"the model '{name}' does not exist")
            entry = await asyncio.to_thread(_load_entry, info)
            self._entries[name] = entry
            return entry

    @staticmethod
    @functools.cache
    def _bundled() -> tuple[str, ...]:
        """The bundled models' names: installed packages, fixed for the process's life
        (read once: describing them parses a GGUF header, and /v1/models is polled)."""
        return tuple(i.name for i in catalog.bundled())

    def known(self) -> list[str]:
        names = set(self._bundled()) | set(self._entries) | set(self.fleet.models())
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
        entry = self._entries.get(name)
        kind = (entry.info.kind if entry else "") or next((w.hb.kind for w in workers), "") \
            or decisions.kind(name) or _bundled_kind(name)
        return ModelCard(id=name, created=entry.created if entry else int(time.time()),
                         kind=kind, versions=sorted({v for w in ready for v in w.hb.versions}),
                         ready_workers=len(ready), state=state,
                         programs_compiled=sum(w.hb.programs_compiled for w in workers),
                         programs_total=sum(w.hb.programs_total for w in workers),
                         **_speculation(workers),
                         reason=status.reason if state == "failed" and status else "")


def _speculation(workers) -> dict[str, float]:
    """The model card's speculative decoding figures over `workers`' heartbeats."""
    drafts = sum(w.hb.spec_decode_drafts for w in workers)
    drafted = sum(w.hb.spec_decode_draft_tokens for w in workers)
    accepted = sum(w.hb.spec_decode_accepted_tokens for w in workers)
    return {"spec_decode_acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_decode_tokens_per_step": round((accepted + drafts) / drafts, 4) if drafts
            else 0.0}


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
                      spec.num_labels, dict(spec.prompts), spec.default_prompt_name, cfg.dim)


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
