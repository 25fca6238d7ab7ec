"""The `tensorbus` command: the embedded nats-server, the registry, and checks.

    tensorbus nats                  run nats-server (JetStream under TENSORBUS_DATA_DIR)
    tensorbus registry ...          push / list / show / promote / canary / rollback
    tensorbus embed TEXT...         one embeddings request over NATS (a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.config import Config


def _nats(args: argparse.Namespace, config: Config) -> int:
    from shared.natsd import main as run_nats

    run_nats(config.nats_port, config.data_dir, args.config)
    return 0


def _embed(args: argparse.Namespace, config: Config) -> int:
    import msgspec
    import nats

    async def go() -> int:
        nc = await nats.connect(config.nats_url)
        try:
            body = msgspec.json.encode({"model": args.model, "input": args.text})
            msg = await nc.request("inference.v1.embeddings", body, timeout=args.timeout)
            sys.stdout.write(msg.data.decode() + "\n")
            return 0 if not (msg.headers or {}).get("Nats-Service-Error-Code") else 1
        finally:
            await nc.close()

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "registry":
        from services.registry.cli import main as registry_main

        return registry_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tensorbus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("nats", help="run the embedded nats-server")
    p.add_argument("--config", help="a nats-server config file (default: generated)")
    p.set_defaults(fn=_nats)
    sub.add_parser("registry", help="model registry (see `tensorbus registry -h`)")
    p = sub.add_parser("embed", help="embed texts over NATS")
    p.add_argument("text", nargs="+")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(fn=_embed)
    args = parser.parse_args(argv)
    return args.fn(args, Config.from_env())


if __name__ == "__main__":
    raise SystemExit(main())
