"""`tensorbus registry ...`: push, import-gguf, list, show, promote, canary, rollback.

Exit status 0 on success, 1 when the registry refuses (the reason on stderr), 2 on a
usage error. `--json` prints the records as stored in KV.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from pathlib import Path

import msgspec
import nats

from services.registry.errors import RegistryError
from services.registry.servable import decoder_refusal, encoder_refusal
from services.registry.store import Registry
from shared import catalog
from shared.bus import open_client
from shared.config import Config
from shared.logging import configure_logging
from shared.registry import Aliases, CanaryGuard, ModelVersion


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorbus registry",
                                description="Model versions and aliases in NATS JetStream.")
    p.add_argument("--nats-url", default=None,
                   help="NATS server(s), comma-separated (default: $TENSORBUS_NATS_URL)")
    p.add_argument("--creds", default=None, metavar="FILE",
                   help="NATS credentials file (user JWT + nkey), when the server wants one "
                        "(default: $TENSORBUS_NATS_CREDS; see also TENSORBUS_NATS_NKEY_SEED)")
    p.add_argument("-v", "--verbose", action="store_true", help="log registry operations")
    sub = p.add_subparsers(dest="command", required=True)

    push = sub.add_parser("push", help="upload a model directory (Hugging Face layout)")
    push.add_argument("dir")
    push.add_argument("--name", required=True)
    push.add_argument("--version", default=None, help="default: the next integer")
    push.add_argument("--lineage", action="append", default=[], metavar="KEY=VALUE",
                      help="e.g. source=ckpt-123 data=s3://bucket/set (repeatable)")
    push.add_argument("--no-progress", action="store_true")
    push.add_argument("--json", action="store_true")

    imp = sub.add_parser("import-gguf", help="upload one GGUF file unchanged (llama.cpp format)")
    imp.add_argument("path", help="the .gguf file")
    imp.add_argument("--name", required=True)
    imp.add_argument("--version", default=None, help="default: the next integer")
    imp.add_argument("--lineage", action="append", default=[], metavar="KEY=VALUE",
                     help="besides source_file and source_sha256, recorded always (repeatable)")
    imp.add_argument("--no-progress", action="store_true")
    imp.add_argument("--json", action="store_true")

    ls = sub.add_parser("list", help="models with their versions and aliases")
    ls.add_argument("--json", action="store_true")

    show = sub.add_parser("show", help="one model (versions, alias history) or one version")
    show.add_argument("ref", metavar="NAME[@VERSION]")
    show.add_argument("--json", action="store_true")

    promote = sub.add_parser("promote", help="point prod at VERSION")
    promote.add_argument("name")
    promote.add_argument("version")

    canary = sub.add_parser("canary", help="send a share of traffic to VERSION")
    canary.add_argument("name")
    canary.add_argument("version")
    canary.add_argument("--weight", type=float, default=0.1, help="share in [0, 1] (0.1)")
    guard = CanaryGuard()
    canary.add_argument("--auto-rollback", action="store_true",
                        help="let the telemetry service clear the canary when it does worse "
                             "than prod (the margins below)")
    canary.add_argument("--window", type=float, default=guard.window_s,
                        help=f"seconds compared (default {guard.window_s:g})")
    canary.add_argument("--min-requests", type=int, default=guard.min_requests,
                        help=f"canary requests needed to judge (default {guard.min_requests})")
    canary.add_argument("--error-margin", type=float, default=guard.error_margin,
                        help="error rate above prod's that rolls back "
                             f"(default {guard.error_margin:g})")
    canary.add_argument("--p95-margin", type=float, default=guard.p95_margin,
                        help="p95 above prod's, as a fraction, that rolls back "
                             f"(default {guard.p95_margin:g})")

    rollback = sub.add_parser("rollback", help="prod back to the previous version, no canary")
    rollback.add_argument("name")
    return p


def main(argv: list[str] | None = None, *, setup_logging: bool = True) -> int:
    """Run one command. `setup_logging=False` leaves structlog as the caller set it."""
    args = build_parser().parse_args(argv)
    config = Config.from_env()
    url = args.nats_url or config.nats_url
    if setup_logging:
        # Output is for people (and --json for scripts); logs go to stderr, quiet.
        configure_logging("registry", level="info" if args.verbose else "warning",
                          fmt=config.log_format)
    try:
        return asyncio.run(_run(args, url))
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (nats.errors.NoServersError, OSError, nats.errors.TimeoutError) as exc:
        print(f"error: cannot reach NATS at {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, url: str) -> int:
    # Unlike a service, a command fails fast when the bus is down (a few retries).
    creds = {"user_credentials": args.creds} if args.creds else {}
    nc = await open_client(url, name="tensorbus-registry-cli", connect_timeout=2,
                           max_reconnect_attempts=2, reconnect_time_wait=0.25,
                           allow_reconnect=True, **creds)
    try:
        reg = await Registry.open(nc)
        return await _COMMANDS[args.command](reg, args)
    finally:
        await nc.drain()


def serving_warning(model_dir: str | Path) -> str | None:
    """Why no worker would serve this directory, read from its config files alone
    (the encoder engines' refusals, engine/encoder/spec.py, and the workers' own:
    services.registry.servable.encoder_refusal; a decoder's quantization_config:
    decoder_refusal); None when none is known.
    A push still goes ahead: the registry stores what it is given."""
    path = Path(model_dir)
    if not (path / "config.json").exists():
        return None  # the push itself says what is missing
    info = catalog.describe(path.name, path)
    if info.kind != "encoder":
        return decoder_refusal(path)
    return encoder_refusal(path)


async def _push(reg: Registry, args) -> int:
    warning = serving_warning(args.dir)
    if warning:
        print(f"warning: workers will refuse this model (exit 78): {warning}", file=sys.stderr)
    mv = await reg.push(args.dir, args.name, version=args.version,
                        lineage=_pairs(args.lineage), progress=not args.no_progress)
    return _pushed(mv, args)


async def _import_gguf(reg: Registry, args) -> int:
    mv = await reg.import_gguf(args.path, args.name, version=args.version,
                               lineage=_pairs(args.lineage), progress=not args.no_progress)
    return _pushed(mv, args)


def _pushed(mv: ModelVersion, args) -> int:
    if args.json:
        _print_json(mv)
    else:
        files = "1 file" if len(mv.files) == 1 else f"{len(mv.files)} files"
        print(f"pushed {mv.name}@{mv.version}: {files}, {_size(mv.total_size)}, "
              f"{mv.format}, {mv.kind}")
    return 0


async def _list(reg: Registry, args) -> int:
    rows = []
    for name in await reg.list_models():
        versions = await reg.versions(name)
        rows.append((name, versions, await reg.aliases(name)))
    if args.json:
        _print_json([{"name": n, "versions": [v.version for v in vs], "aliases": a}
                     for n, vs, a in rows])
        return 0
    if not rows:
        print("no models in the registry")
        return 0
    _table(["MODEL", "KIND", "VERSIONS", "PROD", "CANARY", "UPDATED"], [
        [n, vs[-1].kind if vs else "-", ",".join(v.version for v in vs) or "-",
         a.prod or "-", _canary(a), _when(a.updated_at)] for n, vs, a in rows
    ])
    return 0


async def _show(reg: Registry, args) -> int:
    name, _, version = args.ref.partition("@")
    if version:
        mv = await reg.get(name, version)
        if mv is None:
            raise RegistryError(f"{name}@{version} is not in the registry")
        _print_json(mv) if args.json else _show_version(mv)
        return 0
    versions = await reg.versions(name)
    if not versions:
        raise RegistryError(f"{name} is not in the registry")
    aliases, history = await reg.aliases(name), await reg.alias_history(name)
    if args.json:
        _print_json({"name": name, "versions": versions, "aliases": aliases, "history": history})
        return 0
    print(f"{name}  ({versions[-1].kind})")
    print(f"prod: {aliases.prod or '-'}   canary: {_canary(aliases)}\n")
    _table(["VERSION", "FORMAT", "SIZE", "FILES", "CREATED", "ALIAS"], [
        [v.version, v.format, _size(v.total_size), str(len(v.files)), _when(v.created_at),
         _alias_of(v.version, aliases)] for v in versions
    ])
    print("\nalias history:")
    if not history:
        print("  (none)")
        return 0
    _table(["WHEN", "CHANGE", "PROD", "CANARY", "BY", "REASON"], [
        [_when(h.at), h.change, h.prod or "-",
         f"{h.canary} ({h.canary_weight:g}{', guarded' if h.guarded else ''})" if h.canary
         else "-", h.by, h.reason or ""] for h in history
    ], indent="  ")
    return 0


def _show_version(mv: ModelVersion) -> None:
    print(f"{mv.name}@{mv.version}  {mv.kind}, {mv.format}, {_size(mv.total_size)}, "
          f"max_tokens {mv.max_tokens}")
    print(f"created {_when(mv.created_at)} by {mv.created_by or '-'}")
    for k, v in sorted(mv.lineage.items()):
        print(f"lineage.{k}: {v}")
    print()
    _table(["FILE", "SIZE", "SHA256"], [[f.path, _size(f.size), f.sha256] for f in mv.files])


async def _promote(reg: Registry, args) -> int:
    a = await reg.promote(args.name, args.version)
    print(f"{args.name}: prod -> {a.prod}" + (f", canary {_canary(a)}" if a.canary else ""))
    return 0


async def _set_canary(reg: Registry, args) -> int:
    guard = None
    if args.auto_rollback:
        guard = CanaryGuard(window_s=args.window, min_requests=args.min_requests,
                            error_margin=args.error_margin, p95_margin=args.p95_margin)
    a = await reg.canary(args.name, args.version, args.weight, guard)
    print(f"{args.name}: canary -> {a.canary} at {a.canary_weight:.0%} of traffic "
          f"(prod {a.prod})" + (", automatic rollback on" if guard else ""))
    return 0


async def _rollback(reg: Registry, args) -> int:
    a = await reg.rollback(args.name)
    print(f"{args.name}: prod rolled back to {a.prod}, canary cleared")
    return 0


_COMMANDS = {"push": _push, "import-gguf": _import_gguf, "list": _list, "show": _show,
             "promote": _promote, "canary": _set_canary, "rollback": _rollback}


# --- formatting

def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RegistryError(f"--lineage wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _canary(a: Aliases) -> str:
    return f"{a.canary} ({a.canary_weight:.0%})" if a.canary else "-"


def _alias_of(version: str, a: Aliases) -> str:
    return "prod" if version == a.prod else "canary" if version == a.canary else ""


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%SZ") if t else "-"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]], indent: str = "") -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print(indent + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_json(obj) -> None:
    print(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


if __name__ == "__main__":
    sys.exit(main())
