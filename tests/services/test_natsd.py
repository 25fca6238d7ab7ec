"""`tensorbus nats` (the Procfile's bus) as honcho stops it: a real nats-server in a
real process tree, signalled the way `honcho start` signals it on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from shared.natsd import free_port, wait_listening


def _start(tmp_path, grace_s: float) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "TENSORBUS_NATS_PORT": str(port), "TENSORBUS_DATA_DIR": str(tmp_path),
           "TENSORBUS_NATS_STOP_GRACE_S": str(grace_s)}
    # A session of its own, as honcho gives each Procfile line: killpg reaches it all.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "nats"], env=env,
                            start_new_session=True)
    wait_listening(port)
    return proc, port


async def test_a_stopped_bus_keeps_serving_its_clients_until_they_leave(tmp_path):
    proc, port = _start(tmp_path, grace_s=60)
    try:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")

        async def echo(msg):
            await msg.respond(msg.data)

        await nc.subscribe("echo", cb=echo)
        os.killpg(proc.pid, signal.SIGTERM)  # what honcho does to every process group
        # A draining service's last replies still cross the bus after the signal.
        for i in range(20):
            reply = await nc.request("echo", str(i).encode(), timeout=5)
            assert reply.data == str(i).encode()
        assert proc.poll() is None
        await nc.close()  # the last client leaves: the server stops now, not 60 s later
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_stopped_bus_with_clients_that_stay_stops_after_its_grace(tmp_path):
    proc, port = _start(tmp_path, grace_s=0.5)
    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_idle_bus_stops_at_once(tmp_path, sig):
    proc, _ = _start(tmp_path, grace_s=60)
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=30) == 0


def test_a_killed_benchmark_leaves_no_bus_behind(tmp_path):
    """The supervisor benchmarks and fault tests use ties its nats-server (and its
    services) to the process that started them: a benchmark killed mid-run, even with
    SIGKILL, leaves nothing listening."""
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from services.supervisor import Supervisor\n"
            "sup = Supervisor(Path(sys.argv[1])).__enter__()\n"
            "print(sup.start_nats().proc.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    # The server is our grandchild: once reparented, nothing reaps it, so "gone" is
    # its death (a zombie, or no entry at all).
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "nats-server outlived the process that started it"
        time.sleep(0.02)  # polling the process table, not synchronisation on an event


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
