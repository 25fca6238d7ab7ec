"""The `tensorbus` command: the embedded nats-server, the registry, and checks.

    tensorbus nats                  run nats-server (JetStream under TENSORBUS_DATA_DIR)
    tensorbus nats --cluster 3      three routed nats-servers (ports 4222-4224, routes 6222-6224)
    tensorbus replicas [N]          raise the registry's buckets and TELEMETRY to N replicas
    tensorbus registry ...          push / list / show / promote / canary / rollback
    tensorbus registry warm NAME[@VERSION]   compile a version's programs for the fleet
    tensorbus embed TEXT...         one embeddings request over NATS (a smoke test)
    tensorbus telemetry tail        live telemetry records, one JSON line each
    tensorbus telemetry replay --since 10m   stored records from the TELEMETRY stream
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.config import Config


def _nats(args: argparse.Namespace, config: Config) -> int:
    from shared.natsd import main as run_nats

    if args.cluster < 1:
        print("tensorbus nats: --cluster needs 1 or more servers", file=sys.stderr)
        return 2
    return run_nats(config.nats_port, config.data_dir, args.config, config.nats_stop_grace_s,
                    cluster=args.cluster)


def _replicas(args: argparse.Namespace, config: Config) -> int:
    from shared.bus import open_client
    from shared.jetstream import raise_replicas, replicas

    async def go() -> int:
        try:
            nc = await open_client(config.nats_url, config, name="tensorbus-replicas-cli",
                                   connect_timeout=2, allow_reconnect=False)
        except Exception as exc:  # noqa: BLE001 - any failure to connect ends the command
            print(f"tensorbus replicas: cannot reach NATS at {config.nats_url}: "
                  f"{exc or type(exc).__name__}", file=sys.stderr)
            return 1
        try:
            want = args.n or replicas(nc, config.js_replicas)
            outcome = await raise_replicas(nc, want)
        finally:
            await nc.close()
        for stream, what in outcome.items():
            print(f"{stream:24s} {what}")
        return 1 if any(w.startswith("error") for w in outcome.values()) else 0

    return asyncio.run(go())


def _embed(args: argparse.Namespace, config: Config) -> int:
    import msgspec

    from shared.bus import open_client

    async def go() -> int:
        nc = await open_client(config.nats_url, config)
        try:
            body = msgspec.json.encode({"model": args.model, "input": args.text})
            msg = await nc.request("inference.v1.embeddings", body, timeout=args.timeout)
            sys.stdout.write(msg.data.decode() + "\n")
            return 0 if not (msg.headers or {}).get("Nats-Service-Error-Code") else 1
        finally:
            await nc.close()

    return asyncio.run(go())


def _telemetry(args: argparse.Namespace, config: Config) -> int:
    from nats.js.errors import NotFoundError

    from services.telemetry import consumer
    from shared.bus import open_client

    try:
        flt = consumer.Filter(consumer.parse_kinds(args.kind), args.model or "")
        since = consumer.parse_duration(args.since) if getattr(args, "since", None) else None
    except ValueError as exc:
        print(f"tensorbus telemetry: {exc}", file=sys.stderr)
        return 2

    async def quiet(exc: Exception) -> None:
        pass  # the one error that matters (cannot connect) is reported below

    async def go() -> int:
        try:
            nc = await open_client(config.nats_url, config, name="tensorbus-telemetry-cli",
                                   connect_timeout=2, max_reconnect_attempts=1,
                                   allow_reconnect=False, error_cb=quiet)
        except Exception as exc:  # noqa: BLE001 - any failure to connect ends the command
            print(f"tensorbus telemetry: cannot reach NATS at {config.nats_url}: "
                  f"{exc or type(exc).__name__}", file=sys.stderr)
            return 1
        printer = consumer.Printer(limit=args.limit)
        try:
            if args.action == "replay":
                await consumer.replay(nc, flt, printer, since)
            else:
                from shared.bus import stop_event

                def ready() -> None:
                    print(f"tailing {' '.join(flt.subjects())}", file=sys.stderr, flush=True)

                await consumer.tail(nc, flt, printer, stop_event(), on_ready=ready)
        except BrokenPipeError:
            pass  # the reader went away (`| head`): that is the end, not an error
        except NotFoundError:
            print("tensorbus telemetry: no TELEMETRY stream on this server (the telemetry "
                  "service creates it when it starts)", file=sys.stderr)
            return 1
        finally:
            await nc.close()
        return 0

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["registry", "warm"]:  # builds an engine: the worker's code
        from services.worker.warm import main as warm_main

        return warm_main(argv[2:])
    if argv and argv[0] == "registry":
        from services.registry.cli import main as registry_main

        return registry_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tensorbus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("nats", help="run the embedded nats-server")
    p.add_argument("--config", help="a nats-server config file (default: generated)")
    p.add_argument("--cluster", type=int, default=1, metavar="N",
                   help="run N routed servers on TENSORBUS_NATS_PORT..+N-1 (routes: +2000)")
    p.set_defaults(fn=_nats)
    p = sub.add_parser("replicas", help="set the replicas of the registry buckets and the "
                                        "TELEMETRY stream (in place)")
    p.add_argument("n", type=int, nargs="?", default=0,
                   help="replicas (default: TENSORBUS_JS_REPLICAS, else 3 on a cluster of 3+)")
    p.set_defaults(fn=_replicas)
    sub.add_parser("registry", help="model registry (see `tensorbus registry -h`)")
    p = sub.add_parser("embed", help="embed texts over NATS")
    p.add_argument("text", nargs="+")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(fn=_embed)
    p = sub.add_parser("telemetry", help="print telemetry records as JSON lines")
    tsub = p.add_subparsers(dest="action", required=True)
    for name, text in (("tail", "live records from now on (Ctrl-C to stop)"),
                       ("replay", "stored records from the TELEMETRY stream, then exit")):
        t = tsub.add_parser(name, help=text)
        if name == "replay":
            t.add_argument("--since", help="how far back: 30s, 10m, 2h (default: all kept)")
        t.add_argument("--kind", action="append",
                       help="request | worker | scale | summary (repeat or comma-separate)")
        t.add_argument("--model", help="only records of this model")
        t.add_argument("--limit", type=int, default=0, help="stop after this many lines")
    p.set_defaults(fn=_telemetry)
    args = parser.parse_args(argv)
    return args.fn(args, Config.from_env())


if __name__ == "__main__":
    raise SystemExit(main())
