"""Reading the registry: models, versions, and verified copies of their files.

JetStream holds it all: an Object Store bucket for the files, a KV bucket for the
version records and aliases (layout in `shared/registry.py`, keys in `keys.py`).

`fetch_tokenizer` does the same with only what a gateway reads (`tokenizer_files`:
tokenizer, chat template and configs, or a GGUF file's header), never the weights.

Fetch (one version into a model directory):
1. Read the version's record; only a ready version is fetched.
2. An already verified copy at the destination is reused as is.
3. Download every file into a temporary sibling directory, checking each file's sha256
   and size against the record as the bytes arrive.
4. Write the verified marker, then rename the directory into place, so a half-fetched
   model is never visible.

`Registry` is the one object services and the CLI hold: it reads here, and hands
pushes to `push.Pusher` and alias changes to `aliases.AliasBook`.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import shutil
import socket
import tempfile
from pathlib import Path

import msgspec
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
)
from tqdm import tqdm

from services.registry import files as fs
from services.registry.aliases import AliasBook
from services.registry.election import SteadyKV, through
from services.registry.errors import RegistryError, VersionNotFound
from services.registry.keys import (
    META_PREFIX,
    META_STREAM,
    check_name,
    name_of,
    object_name,
    tokenizer_object_name,
    version_key,
    versions_pattern,
)
from services.registry.programs import Shelf
from services.registry.push import Pusher
from services.registry.watch import AliasWatch
from shared import subjects
from shared.jetstream import check_replicas, replicas
from shared.logging import get_logger
from shared.registry import READY, Aliases, AliasChange, CanaryGuard, FileEntry, ModelVersion

log = get_logger("registry")

KV_HISTORY = 64  # the most JetStream KV keeps per key


class Registry:
    """Both buckets behind one object. Build it with `await Registry.open(nc)`.

    It reads itself; pushes go to `push.Pusher` and aliases to `aliases.AliasBook`,
    each one line here, so callers keep one object and each concept one module."""

    def __init__(self, js, kv, objects, actor: str | None = None, nc=None) -> None:
        self._js = js
        kv = SteadyKV(kv)  # reads and writes go through an election (election.py)
        self._kv = kv
        self._obj = objects
        self.actor = actor or _actor()
        self._pusher = Pusher(kv, objects, self.records, self.actor, nc)
        self._aliases = AliasBook(js, kv, self, self.actor)
        self.programs = Shelf(kv, objects, self._scan, self.actor)  # compiled, per version

    @classmethod
    async def open(cls, nc, actor: str | None = None) -> "Registry":
        """Bind both buckets, creating them when missing (safe to race)."""
        js = nc.jetstream()
        try:
            kv = await js.key_value(subjects.REGISTRY_META)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                bucket=subjects.REGISTRY_META, history=KV_HISTORY,
                description="tensorbus model metadata and aliases", replicas=replicas(nc),
            )
        else:
            kept = (await kv.status()).history
            if kept < KV_HISTORY:
                log.warning("registry_history_short", bucket=subjects.REGISTRY_META,
                            history=kept, wanted=KV_HISTORY)
        try:
            obj = await js.object_store(subjects.REGISTRY_OBJECTS)
        except BucketNotFoundError:
            obj = await js.create_object_store(
                subjects.REGISTRY_OBJECTS, description="tensorbus model files",
                replicas=replicas(nc),
            )
        await check_replicas(nc, (f"KV_{subjects.REGISTRY_META}", f"OBJ_{subjects.REGISTRY_OBJECTS}"))
        return cls(js, kv, obj, actor, nc=nc)

    # --- reading versions

    async def _scan(self, pattern: str) -> list:
        """Latest entry of every key matching `pattern` (deleted and purged keys left
        out). The keys come from the stream's own subject index and each value from
        a get: a watch's end-of-initial-values marker can arrive before entries still
        in flight (nats.py issue 842), and a listing under load then missed versions."""
        info = await through(lambda: self._js.stream_info(
            META_STREAM, subjects_filter=META_PREFIX + pattern), "list versions")
        out = []
        for subject in sorted(info.state.subjects or {}):
            try:
                out.append(await self._kv.get(subject[len(META_PREFIX):]))
            except (KeyNotFoundError, KeyDeletedError):
                continue
        return out

    async def list_models(self) -> list[str]:
        return sorted({name_of(e.key) for e in await self._scan(versions_pattern())})

    async def records(self, name: str) -> list[ModelVersion]:
        """Every version record of `name`, pending ones included."""
        entries = await self._scan(versions_pattern(name))
        return [msgspec.json.decode(e.value, type=ModelVersion) for e in entries]

    async def versions(self, name: str) -> list[ModelVersion]:
        """Ready versions of `name`, oldest first."""
        check_name("model name", name)
        ready = [m for m in await self.records(name) if m.status == READY]
        return sorted(ready, key=lambda m: (m.created_at, _version_order(m.version)))

    async def get(self, name: str, version: str) -> ModelVersion | None:
        """The ready version's record; None when absent or still uploading."""
        check_name("model name", name)
        check_name("version", version)
        try:
            entry = await self._kv.get(version_key(name, version))
        except KeyNotFoundError:
            return None
        mv = msgspec.json.decode(entry.value, type=ModelVersion)
        return mv if mv.status == READY else None

    async def require(self, name: str, version: str) -> ModelVersion:
        """Like `get`, raising VersionNotFound instead of returning None."""
        mv = await self.get(name, version)
        if mv is None:
            raise VersionNotFound(f"{name}@{version} is not in the registry")
        return mv

    # --- fetching

    async def fetch(self, name: str, version: str, dest_dir: str | Path,
                    progress: bool = False, local: Path | None = None) -> Path:
        """Download a version into `dest_dir` (the model directory itself), verified.

        An already verified copy there is reused. Files land in a temporary sibling
        directory that is renamed to `dest_dir` only after every sha256 matched. A
        file `local` (a directory, e.g. the bundled model's) holds with the entry's
        size and sha256 is copied from there instead of downloaded.
        """
        mv = await self.require(name, version)
        dest = await self._fetch_into(mv, Path(dest_dir), progress, local=local)
        log.info("model_fetched", model=name, version=version, path=str(dest))
        return dest

    async def fetch_tokenizer(self, name: str, version: str, dest_dir: str | Path) -> Path:
        """Download what a gateway reads of a version (`tokenizer_files`), never its
        weights, into `dest_dir`, verified as `fetch` does."""
        mv = await self.require(name, version)
        light = msgspec.structs.replace(mv, files=tokenizer_files(mv))
        dest = await self._fetch_into(light, Path(dest_dir), False,
                                      lambda e: tokenizer_object_name(mv, e))
        log.info("tokenizer_fetched", model=name, version=version, path=str(dest),
                 files=len(light.files), bytes=sum(e.size for e in light.files))
        return dest

    async def _fetch_into(self, mv: ModelVersion, dest: Path, progress: bool,
                          objects=None, local: Path | None = None) -> Path:
        """`mv`'s files into `dest`, through a temporary sibling renamed into place
        once every sha256 matched; a verified copy already there is kept."""
        if fs.is_verified_copy(dest, mv):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.fetch-", dir=dest.parent))
        try:
            await self._download(mv, tmp, progress, objects, local)
            fs.write_marker(tmp, mv)
            _publish_dir(tmp, dest, mv)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    async def _download(self, mv: ModelVersion, root: Path, progress: bool,
                        objects=None, local: Path | None = None) -> None:
        """Every file of `mv` under `root`; `objects(entry)` names each one's object
        (default: the version's file of that path)."""
        with tqdm(total=mv.total_size, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"fetch {mv.name}@{mv.version}", disable=not progress) as bar:
            for entry in mv.files:
                path = fs.safe_join(root, entry.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                if local is not None and await asyncio.to_thread(fs.copy_if_same, local,
                                                                 entry, path):  # fmt: skip
                    bar.update(entry.size)
                    continue
                obj = (objects(entry) if objects is not None
                       else object_name(mv.name, mv.version, entry.path))
                with open(path, "wb") as f:
                    await fs.get_checked(self._obj, obj, f, entry.size, entry.sha256, bar)

    # --- pushing: push.Pusher

    async def push(self, model_dir: str | Path, name: str, version: str | None = None,
                   lineage: dict[str, str] | None = None, progress: bool = True) -> ModelVersion:
        return await self._pusher.push(model_dir, name, version, lineage, progress)

    async def import_gguf(self, path: str | Path, name: str, version: str | None = None,
                          lineage: dict[str, str] | None = None,
                          progress: bool = True) -> ModelVersion:
        return await self._pusher.import_gguf(path, name, version, lineage, progress)

    # --- aliases: aliases.AliasBook

    async def aliases(self, name: str) -> Aliases:
        return await self._aliases.aliases(name)

    async def alias_history(self, name: str) -> list[AliasChange]:
        return await self._aliases.history(name)

    def watch_aliases(self, name: str, include_current: bool = True) -> AliasWatch:
        return self._aliases.watch(name, include_current)

    async def promote(self, name: str, version: str) -> Aliases:
        return await self._aliases.promote(name, version)

    async def canary(self, name: str, version: str, weight: float,
                     guard: CanaryGuard | None = None) -> Aliases:
        return await self._aliases.canary(name, version, weight, guard)

    async def rollback(self, name: str) -> Aliases:
        return await self._aliases.rollback(name)

    async def abort_canary(self, name: str, version: str, reason: str,
                           figures: dict[str, float]) -> Aliases | None:
        return await self._aliases.abort_canary(name, version, reason, figures)

    async def promote_if_unset(self, name: str, version: str, change: str = "seed") -> bool:
        return await self._aliases.promote_if_unset(name, version, change)


def tokenizer_files(mv: ModelVersion) -> list[FileEntry]:
    """What a gateway fetches of `mv`: its recorded `tokenizer` files. A record from
    before they were recorded: a directory's files other than weights (the same
    objects); a GGUF version has no header object, and is refused with the reason."""
    if mv.tokenizer:
        return list(mv.tokenizer)
    if mv.format == fs.GGUF:
        raise RegistryError(f"{mv.name}@{mv.version} was imported before GGUF headers were "
                            f"stored on their own, so a gateway cannot read its tokenizer "
                            f"without the weights; import the file again as a new version")
    return fs.gateway_files(mv.files)


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _version_order(v: str) -> tuple[int, int | str]:
    return (0, int(v)) if v.isdigit() else (1, v)


def _publish_dir(tmp: Path, dest: Path, mv: ModelVersion) -> None:
    """Rename the verified `tmp` to `dest`, replacing a stale copy there."""
    if dest.exists():
        if fs.is_verified_copy(dest, mv):  # another fetcher finished first
            return
        trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, trash / "dir")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, dest)
    except OSError:
        # A concurrent fetcher renamed its copy into place between our check and here.
        if not fs.is_verified_copy(dest, mv):
            raise


async def open_or_none(nc, why: str) -> Registry | None:
    """The registry, or None (logged with `why` the service carries on without it)
    when JetStream is unusable."""
    try:
        return await Registry.open(nc)
    except Exception as exc:  # noqa: BLE001 - every caller has a fallback
        log.warning("registry_unavailable", error=str(exc), fallback=why)
        return None
