"""`python -m services.<name> --check ready|health`: an exec probe.

`ready` goes over NATS: it asks `tensorbus.v1.svc.<service>.ready`, gathers the answers
(every instance answers), and exits 0 if the one from this instance says ok, 1
otherwise — within `timeout`. The instance is recognised by the id it reports in
`details.instance`; without a configured id, any instance named after this host
counts. A pod the bus cannot reach is not ready, so it gets no work.

`health` (liveness) does not touch the bus: it reads the file the service keeps
(services/liveness.py), so a NATS outage takes pods out of rotation but never
restarts them. Imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import msgspec


async def probe(url: str, service: str, kind: str, instance: str, timeout: float = 3.0) -> bool:
    from services.micro import health_subject, ready_subject
    from shared.bus import open_client

    subject = ready_subject(service) if kind == "ready" else health_subject(service)
    # nats-py retries a refused first connect (max_reconnect_attempts, 2 s apart) even
    # without reconnects: bound the whole attempt, so a bus that is down says so in time.
    nc = await asyncio.wait_for(
        open_client(url, connect_timeout=min(2.0, timeout), allow_reconnect=False),
        min(2.0, timeout))
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subject, b"", reply=inbox)
        end = time.monotonic() + timeout
        host = socket.gethostname() + "-"
        while (left := end - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # noqa: BLE001 - timeout: no answer from this instance
                return False
            try:
                body = msgspec.json.decode(msg.data)
            except msgspec.DecodeError:
                continue
            who = str((body.get("details") or {}).get("instance", ""))
            if who == instance or (not instance and who.startswith(host)):
                return body.get("status") == "ok"
        return False
    finally:
        await nc.close()


def run_check(argv: list[str], service: str, instance: str) -> None:
    """If argv asks for `--check KIND`, probe and exit; otherwise return."""
    if "--check" not in argv:
        return
    i = argv.index("--check")
    kind = argv[i + 1] if i + 1 < len(argv) else "ready"
    if kind not in ("ready", "health"):
        raise SystemExit("usage: --check ready|health")
    from shared.config import Config

    config = Config.from_env()
    if kind == "health":
        from services.liveness import is_live, live_file

        path = live_file(service, config)
        if not is_live(path):
            sys.stderr.write(f"not live: {path} is missing, stale or not ok\n")
            raise SystemExit(1)
        raise SystemExit(0)
    try:
        ok = asyncio.run(probe(config.nats_url, service, kind, instance or _instance(service, config)))
    except Exception as exc:  # noqa: BLE001 - any failure is "not ok"
        sys.stderr.write(f"probe failed: {exc or type(exc).__name__}\n")
        ok = False
    raise SystemExit(0 if ok else 1)


def _instance(service: str, config) -> str:
    return config.worker_id if service == "tensorbus-worker" else config.scheduler_id
