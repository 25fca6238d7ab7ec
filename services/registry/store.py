"""The model registry: JetStream Object Store for files, KV for metadata and aliases.

Push (one version):
1. Scan the directory (HF layout), read kind from config.json, format from file names.
   (`import_gguf`: one GGUF file, kind and config from its header, sha256 first.)
2. Reserve the version key in KV with `create` (status pending): two pushers can never
   take the same version; auto versions retry with the next integer.
3. Stream every file into the Object Store as `NAME/VERSION/PATH`, hashing the bytes
   as they are uploaded.
4. Replace the pending record with the ready one (revision-checked update).

Fetch verifies each file's sha256 while it downloads into a temporary directory and
renames it into place only when all matched, so a half-fetched model is never visible.

Aliases are one KV key per model; every change is a revision-checked update, and the
key's history (64 revisions) is the record of who served what, when.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import shutil
import socket
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Awaitable, Callable

import msgspec
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    DigestMismatchError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE
from tqdm import tqdm

from services.registry import files as fs
from services.registry.errors import (
    ChecksumError,
    IncompatibleVersion,
    InvalidWeight,
    NothingToRollBack,
    RegistryError,
    VersionExists,
    VersionNotFound,
)
from services.registry.watch import AliasWatch, alias_change, decode_aliases
from shared import catalog, gguf, subjects
from shared.jetstream import replicas
from shared.logging import get_logger
from shared.registry import (NAME_RE, PENDING, READY, Aliases, AliasChange, CanaryGuard,
                             ModelVersion)

__all__ = ["Registry", "ChecksumError", "VersionNotFound", "IncompatibleVersion",
           "InvalidWeight", "NothingToRollBack", "RegistryError", "VersionExists"]

log = get_logger("registry")

KV_HISTORY = 64  # the most JetStream KV keeps per key
META_STREAM = f"KV_{subjects.REGISTRY_META}"  # the stream behind the metadata bucket
META_PREFIX = f"$KV.{subjects.REGISTRY_META}."  # its keys' subjects start with this
CHUNK_SIZE = 256 * 1024  # below the server's default 1 MiB max payload
MAX_PREVIOUS = 32  # prod versions remembered for rollback
STALE_PENDING = timedelta(minutes=15)  # a reservation this old was abandoned
_CAS_ATTEMPTS = 16


def _token(s: str) -> str:
    # Dots separate subject tokens; names may contain them, `=` never appears in one.
    return s.replace(".", "=")


def version_key(name: str, version: str) -> str:
    return f"model.{_token(name)}.v.{_token(version)}"


def alias_key(name: str) -> str:
    return f"model.{_token(name)}.aliases"


def object_name(name: str, version: str, path: str) -> str:
    return f"{name}/{version}/{path}"


def _check_name(what: str, value: str) -> None:
    if not NAME_RE.match(value):
        raise RegistryError(f"invalid {what} {value!r}: use letters, digits, '.', '_', '-'")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _version_order(v: str) -> tuple[int, int | str]:
    return (0, int(v)) if v.isdigit() else (1, v)


class Registry:
    """Both buckets behind one object. Build it with `await Registry.open(nc)`."""

    def __init__(self, js, kv, objects, actor: str | None = None, nc=None) -> None:
        self._nc = nc  # the connection, where known: cleanup skips calls while it is down
        self._js = js
        self._kv = kv
        self._obj = objects
        self.actor = actor or _actor()

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
        return cls(js, kv, obj, actor, nc=nc)

    # --- reading

    async def _scan(self, pattern: str) -> list:
        """Latest entry of every key matching `pattern` (deleted and purged keys left
        out). The keys come from the stream's own subject index and each value from
        a get: a watch's end-of-initial-values marker can arrive before entries still
        in flight (nats.py issue 842), and a listing under load then missed versions."""
        info = await self._js.stream_info(META_STREAM, subjects_filter=META_PREFIX + pattern)
        out = []
        for subject in sorted(info.state.subjects or {}):
            try:
                out.append(await self._kv.get(subject[len(META_PREFIX):]))
            except (KeyNotFoundError, KeyDeletedError):
                continue
        return out

    async def list_models(self) -> list[str]:
        entries = await self._scan("model.*.v.*")
        return sorted({e.key.split(".")[1].replace("=", ".") for e in entries})

    async def _records(self, name: str) -> list[ModelVersion]:
        """Every version record of `name`, pending ones included."""
        entries = await self._scan(f"model.{_token(name)}.v.*")
        return [msgspec.json.decode(e.value, type=ModelVersion) for e in entries]

    async def versions(self, name: str) -> list[ModelVersion]:
        """Ready versions of `name`, oldest first."""
        _check_name("model name", name)
        ready = [m for m in await self._records(name) if m.status == READY]
        return sorted(ready, key=lambda m: (m.created_at, _version_order(m.version)))

    async def get(self, name: str, version: str) -> ModelVersion | None:
        _check_name("model name", name)
        _check_name("version", version)
        entry = await self._get_entry(version_key(name, version))
        if entry is None:
            return None
        mv = msgspec.json.decode(entry.value, type=ModelVersion)
        return mv if mv.status == READY else None

    async def _get_entry(self, key: str):
        try:
            return await self._kv.get(key)
        except KeyNotFoundError:
            return None

    async def _require(self, name: str, version: str) -> ModelVersion:
        mv = await self.get(name, version)
        if mv is None:
            raise VersionNotFound(f"{name}@{version} is not in the registry")
        return mv

    async def aliases(self, name: str) -> Aliases:
        _check_name("model name", name)
        entry = await self._get_entry(alias_key(name))
        return Aliases() if entry is None else decode_aliases(entry.value)

    async def alias_history(self, name: str) -> list[AliasChange]:
        """Every kept revision of the model's aliases, oldest first: the stream's
        messages on the key's subject, one get each (a KV `history()` rests on a watch,
        whose end marker can come early: see `_scan`)."""
        _check_name("model name", name)
        subject = META_PREFIX + alias_key(name)
        out, seq = [], 1
        while True:
            try:
                msg = await self._js.get_msg(META_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return out
            if (msg.headers or {}).get(KV_OP) not in (KV_DEL, KV_PURGE) and msg.data:
                out.append(alias_change(msg.seq, decode_aliases(msg.data)))
            seq = msg.seq + 1

    def watch_aliases(self, name: str, include_current: bool = True) -> AliasWatch:
        """Async iterator of `Aliases`: the current value first, then every change."""
        _check_name("model name", name)
        return AliasWatch(self._kv, alias_key(name), include_current)

    # --- pushing

    async def push(self, model_dir: str | Path, name: str, version: str | None = None,
                   lineage: dict[str, str] | None = None, progress: bool = True) -> ModelVersion:
        """Upload a model directory as a new version; returns its metadata."""
        _check_name("model name", name)
        if version is not None:
            _check_name("version", version)
        model_dir = Path(model_dir)
        paths = fs.scan(model_dir)
        info = catalog.describe(name, model_dir)
        fmt = fs.weight_format([rel for rel, _ in paths])
        config = msgspec.json.decode((model_dir / "config.json").read_bytes())
        draft = ModelVersion(
            name=name, version=version or "", kind=info.kind, format=fmt,
            max_tokens=info.max_tokens, created_at=_now(), created_by=self.actor,
            lineage=dict(lineage or {}), config=config, status=PENDING,
        )
        return await self._publish(draft, paths, progress, explicit=version is not None)

    async def import_gguf(self, path: str | Path, name: str, version: str | None = None,
                          lineage: dict[str, str] | None = None,
                          progress: bool = True) -> ModelVersion:
        """Upload one GGUF file, byte for byte, as a new version (format `gguf`).

        Its config is read from the header (a Llama-family decoder), the lineage gets
        the source file's name and sha256; a fetch gives a directory holding the file,
        which the engines load as a model directory.
        """
        _check_name("model name", name)
        if version is not None:
            _check_name("version", version)
        path = Path(path)
        header, config = fs.read_gguf(path)
        digest = await asyncio.to_thread(fs.sha256_file, path)
        lineage = {**(lineage or {}), "source_file": path.name, "source_sha256": digest}
        draft = ModelVersion(
            name=name, version=version or "", kind="decoder", format=fs.GGUF,
            max_tokens=gguf.context_length(header), created_at=_now(), created_by=self.actor,
            lineage=lineage, config=config, status=PENDING,
        )
        return await self._publish(draft, [(path.name, path)], progress,
                                   explicit=version is not None, expect_sha256=digest)

    async def _publish(self, draft: ModelVersion, paths: list[tuple[str, Path]], progress: bool,
                       explicit: bool, expect_sha256: str | None = None) -> ModelVersion:
        """Reserve the version, upload the files, mark it ready; undo on any failure."""
        name = draft.name
        draft, rev = await self._reserve(draft, explicit=explicit)
        try:
            entries = await self._upload(draft, paths, progress)
            if expect_sha256 is not None and entries[0].sha256 != expect_sha256:
                raise RegistryError(f"{paths[0][1]} changed while it was uploaded; try again")
            ready = msgspec.structs.replace(
                draft, files=entries, total_size=sum(e.size for e in entries), status=READY,
            )
            await self._kv.update(version_key(name, draft.version),
                                  msgspec.json.encode(ready), last=rev)
        except BaseException:
            await asyncio.shield(self._abandon(draft, [rel for rel, _ in paths]))
            raise
        log.info("model_pushed", model=name, version=ready.version, files=len(entries),
                 bytes=ready.total_size, format=ready.format, kind=ready.kind)
        return ready

    async def _reserve(self, draft: ModelVersion, explicit: bool) -> tuple[ModelVersion, int]:
        """Claim the version key (KV create); auto versions take the next free integer."""
        for _ in range(_CAS_ATTEMPTS):
            if explicit:
                version = draft.version
            else:
                taken = [int(m.version) for m in await self._records(draft.name)
                         if m.version.isdigit()]
                version = str(max(taken, default=0) + 1)
            mv = msgspec.structs.replace(draft, version=version)
            key = version_key(mv.name, version)
            try:
                return mv, await self._kv.create(key, msgspec.json.encode(mv))
            except KeyWrongLastSequenceError:
                pass
            if explicit:
                rev = await self._take_stale(key, mv)
                if rev is None:
                    raise VersionExists(f"{mv.name}@{version} already exists")
                return mv, rev
        raise RegistryError(f"could not reserve a version of {draft.name}: too much contention")

    async def _take_stale(self, key: str, mv: ModelVersion) -> int | None:
        """Take over a pending reservation whose pusher gave up long ago."""
        entry = await self._get_entry(key)
        if entry is None:
            return None
        old = msgspec.json.decode(entry.value, type=ModelVersion)
        if old.status != PENDING or _now() - old.created_at < STALE_PENDING:
            return None
        try:
            return await self._kv.update(key, msgspec.json.encode(mv), last=entry.revision)
        except KeyWrongLastSequenceError:
            return None

    async def _upload(self, mv: ModelVersion, paths: list[tuple[str, Path]],
                      progress: bool) -> list:
        total = sum(p.stat().st_size for _, p in paths)
        entries = []
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"push {mv.name}@{mv.version}", disable=not progress) as bar:
            for rel, path in paths:
                with open(path, "rb") as f:
                    reader = fs.HashingReader(f, bar)
                    await self._put_file(object_name(mv.name, mv.version, rel), reader)
                entries.append(fs.file_entry(rel, reader))
        return entries

    async def _put_file(self, name: str, reader: fs.HashingReader) -> None:
        """Upload one object; a cancellation stops it at the next chunk.

        nats-py's publish path can swallow a CancelledError, and a put cancelled at an
        await leaves its chunks behind. So the put runs shielded, and a cancellation
        aborts its reader instead: the put then fails the ordinary way, purging the
        chunks it sent, and the cancellation carries on from here.
        """
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
        put = asyncio.ensure_future(self._obj.put(name, reader, meta=meta))
        try:
            await asyncio.shield(put)
        except asyncio.CancelledError:
            reader.abort()
            if self._bus_down():  # its publishes would each wait out their timeout
                put.add_done_callback(lambda t: t.cancelled() or t.exception())
                put.cancel()
            else:
                await asyncio.gather(put, return_exceptions=True)
            raise

    async def _abandon(self, mv: ModelVersion, rels: list[str]) -> None:
        """Undo a failed push: drop uploaded objects and the reservation. Best effort:
        the first call that fails stops the rest (the bus is likely gone, and each call
        would wait out its own timeout, holding a stopping service for a minute); what
        is left behind is a pending reservation, which a later push of that version
        takes over once it is stale (`_take_stale`), and orphaned chunks."""
        try:
            for rel in rels:
                self._require_bus()
                with contextlib.suppress(ObjectNotFoundError):
                    await self._obj.delete(object_name(mv.name, mv.version, rel))
            self._require_bus()
            await self._kv.purge(version_key(mv.name, mv.version))
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("abandon_failed", model=mv.name, version=mv.version,
                        error=str(exc) or type(exc).__name__)

    def _bus_down(self) -> bool:
        return self._nc is not None and not self._nc.is_connected

    def _require_bus(self) -> None:
        if self._bus_down():
            raise ConnectionError("not connected to nats-server")

    # --- fetching

    async def fetch(self, name: str, version: str, dest_dir: str | Path,
                    progress: bool = False) -> Path:
        """Download a version into `dest_dir` (the model directory itself), verified.

        An already verified copy there is reused. Files land in a temporary sibling
        directory that is renamed to `dest_dir` only after every sha256 matched.
        """
        mv = await self._require(name, version)
        dest = Path(dest_dir)
        if fs.is_verified_copy(dest, mv):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.fetch-", dir=dest.parent))
        try:
            await self._download(mv, tmp, progress)
            fs.write_marker(tmp, mv)
            _publish_dir(tmp, dest, mv)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("model_fetched", model=name, version=version, path=str(dest))
        return dest

    async def _download(self, mv: ModelVersion, root: Path, progress: bool) -> None:
        with tqdm(total=mv.total_size, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"fetch {mv.name}@{mv.version}", disable=not progress) as bar:
            for entry in mv.files:
                path = fs.safe_join(root, entry.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                obj = object_name(mv.name, mv.version, entry.path)
                with open(path, "wb") as f:
                    writer = fs.HashingWriter(f, bar)
                    try:
                        await self._obj.get(obj, writeinto=writer)
                    except ObjectNotFoundError:
                        raise ChecksumError(f"{obj} is missing from the object store") from None
                    except DigestMismatchError:
                        raise ChecksumError(f"{obj} is corrupted in the object store") from None
                if fs.file_entry(entry.path, writer) != entry:
                    raise ChecksumError(
                        f"{obj}: sha256 {writer.sha.hexdigest()} ({writer.size} bytes) does not "
                        f"match the registry's {entry.sha256} ({entry.size} bytes)"
                    )

    # --- aliases

    async def promote(self, name: str, version: str) -> Aliases:
        """Point `prod` at `version`; the old prod is remembered for rollback."""
        mv = await self._require(name, version)

        async def change(cur: Aliases) -> Aliases | None:
            if cur.prod == version:
                return None
            await self._check_kind(name, cur, mv)
            previous = (cur.previous + [cur.prod])[-MAX_PREVIOUS:] if cur.prod else cur.previous
            canary_stays = cur.canary and cur.canary != version
            return self._stamp(cur, "promote", prod=version, previous=previous,
                               canary=cur.canary if canary_stays else "",
                               canary_weight=cur.canary_weight if canary_stays else 0.0,
                               guard=cur.guard if canary_stays else None)

        return await self._change_aliases(name, change)

    async def canary(self, name: str, version: str, weight: float,
                     guard: CanaryGuard | None = None) -> Aliases:
        """Send `weight` of the traffic to `version`, the rest to prod; with a `guard`
        the telemetry service rolls it back on its own (CanaryGuard)."""
        weight = float(weight)
        if not 0.0 <= weight <= 1.0:  # NaN fails too
            raise InvalidWeight(f"canary weight must be within [0, 1], got {weight}")
        if guard is not None and not (guard.window_s > 0 and guard.min_requests >= 1
                                      and guard.error_margin >= 0 and guard.p95_margin >= 0):
            raise RegistryError(f"automatic rollback needs a window > 0, at least 1 request "
                                f"and margins >= 0, got {guard}")
        mv = await self._require(name, version)

        async def change(cur: Aliases) -> Aliases:
            if not cur.prod:
                raise RegistryError(f"{name} has no prod version: promote one before a canary")
            if cur.prod == version:
                raise RegistryError(f"{name}@{version} is already prod")
            await self._check_kind(name, cur, mv)
            return self._stamp(cur, "canary", canary=version, canary_weight=weight, guard=guard)

        return await self._change_aliases(name, change)

    async def rollback(self, name: str) -> Aliases:
        """Move prod back to the version before it and clear the canary."""

        async def change(cur: Aliases) -> Aliases:
            if not cur.previous:
                raise NothingToRollBack(f"{name} has no earlier prod version to roll back to")
            return self._stamp(cur, "rollback", prod=cur.previous[-1],
                               previous=cur.previous[:-1], canary="", canary_weight=0.0,
                               guard=None)

        return await self._change_aliases(name, change)

    async def abort_canary(self, name: str, version: str, reason: str,
                           figures: dict[str, float]) -> Aliases | None:
        """Clear the canary if it is still `version` (prod stays), recording why and
        on what figures: the automatic rollback. None when the canary had changed."""
        done = False

        async def change(cur: Aliases) -> Aliases | None:
            nonlocal done
            if cur.canary != version:
                return None
            done = True
            return self._stamp(cur, "auto-rollback", canary="", canary_weight=0.0, guard=None,
                               reason=reason, figures=figures)

        new = await self._change_aliases(name, change)
        return new if done else None

    async def promote_if_unset(self, name: str, version: str, change: str = "seed") -> bool:
        """Create the aliases with prod = `version` unless the model has aliases already."""
        await self._require(name, version)
        new = self._stamp(Aliases(), change, prod=version)
        try:
            await self._kv.create(alias_key(name), msgspec.json.encode(new))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _check_kind(self, name: str, cur: Aliases, mv: ModelVersion) -> None:
        if not cur.prod:
            return
        prod = await self.get(name, cur.prod)
        if prod is not None and prod.kind != mv.kind:
            raise IncompatibleVersion(
                f"{name}@{mv.version} is a {mv.kind} but {name} serves a {prod.kind} "
                f"(prod {cur.prod}); push it under another name"
            )

    def _stamp(self, cur: Aliases, change: str, **fields) -> Aliases:
        fields.setdefault("reason", "")  # a reason belongs to the revision that gave it
        fields.setdefault("figures", {})
        return msgspec.structs.replace(cur, updated_at=_now(), change=change, by=self.actor,
                                       **fields)

    async def _change_aliases(
        self, name: str, change: Callable[[Aliases], Awaitable[Aliases | None]]
    ) -> Aliases:
        """Read, change, write with a revision check; retry when someone else won."""
        key = alias_key(name)
        for _ in range(_CAS_ATTEMPTS):
            entry = await self._get_entry(key)
            cur = Aliases() if entry is None else decode_aliases(entry.value)
            new = await change(cur)
            if new is None:
                return cur
            try:
                if entry is None:
                    await self._kv.create(key, msgspec.json.encode(new))
                else:
                    await self._kv.update(key, msgspec.json.encode(new), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            log.info("aliases_changed", model=name, change=new.change, prod=new.prod,
                     canary=new.canary, canary_weight=new.canary_weight, by=new.by,
                     reason=new.reason or None)
            return new
        raise RegistryError(f"aliases of {name} changed concurrently too often; try again")


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
