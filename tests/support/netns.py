"""Two hosts on one machine (tests): Linux network namespaces joined by a veth pair.

`Link` makes two namespaces with names of their own (a random tag: tests and other
runs never share them), joined by a veth pair on a private /30 (`A_ADDR`, `B_ADDR`),
loopback up in each, and deletes both however the test ends (the veth pair goes with
them). Nothing in a namespace can reach the machine's own network, nor the other
namespace except over the pair. It needs root (CI runs the suite as root) and
iproute2's `ip`; without them it fails with a message that says so.

A delay between the hosts is put on the veth pair itself by netem when the kernel has
it (`delay_by == "netem"`); when it has not (`"relay"`), the caller carries the link
through tests/support/relay.py inside a namespace. `cut()` takes the pair down: a
partition at the network layer (packets stop, no connection is closed), `mend()` up.

Processes go into a namespace with `Host.launcher` (`ip netns exec NAME ...`). Python
services run on an `NsLoop`: an asyncio loop on a thread that entered the namespace
(setns moves the calling thread alone), so every socket that loop opens, connections
and listeners, belongs to the namespace; `await loop.call(fn, *args)` runs the
coroutine `fn(*args)` there from the test's own loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
A_ADDR, B_ADDR, PREFIX = "10.231.0.1", "10.231.0.2", 30

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class NetnsUnavailable(RuntimeError):
    pass


def require() -> None:
    """Fail clearly where hosts cannot be simulated here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "simulating hosts needs network namespaces, which need root: run this test as "
            "root (CI does)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed (apt-get install iproute2)")


def ip(*args: str, ns: str | None = None) -> str:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def enter(ns: str) -> None:
    """Move the calling thread (alone) into network namespace `ns`."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    ns: str  # the namespace's name
    dev: str  # its end of the veth pair
    addr: str  # that end's address

    @property
    def launcher(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


class Link:
    """Two namespaces `a` and `b` joined by a veth pair; `delay_s` each way."""

    def __init__(self, delay_s: float = 0.0) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a = Host(f"tb{tag}a", f"tb{tag}a", A_ADDR)
        self.b = Host(f"tb{tag}b", f"tb{tag}b", B_ADDR)
        self.delay_s = delay_s
        self.delay_by = ""  # "netem", "relay", or "" (no delay asked)
        self.made: list[str] = []

    def up(self) -> "Link":
        require()
        try:
            for h in (self.a, self.b):
                try:
                    ip("netns", "add", h.ns)
                except RuntimeError as e:
                    raise NetnsUnavailable(f"cannot make a network namespace here: {e}") from e
                self.made.append(h.ns)
            ip("link", "add", self.a.dev, "netns", self.a.ns, "type", "veth",
               "peer", "name", self.b.dev, "netns", self.b.ns)
            for h in (self.a, self.b):
                ip("addr", "add", f"{h.addr}/{PREFIX}", "dev", h.dev, ns=h.ns)
                ip("link", "set", "lo", "up", ns=h.ns)
                ip("link", "set", h.dev, "up", ns=h.ns)
            if self.delay_s > 0:
                self.delay_by = "netem" if self._netem() else "relay"
        except BaseException:
            self.down()
            raise
        return self

    def _netem(self) -> bool:
        """Delay each end's sending by delay_s; false if the kernel has no netem."""
        ms = f"{self.delay_s * 1e3:g}ms"
        done = []
        for h in (self.a, self.b):
            r = subprocess.run(h.launcher + ["tc", "qdisc", "add", "dev", h.dev, "root",
                                             "netem", "delay", ms], capture_output=True)
            if r.returncode:
                for d in done:
                    subprocess.run(d.launcher + ["tc", "qdisc", "del", "dev", d.dev, "root"],
                                   capture_output=True)
                return False
            done.append(h)
        return True

    def cut(self) -> None:
        ip("link", "set", self.a.dev, "down", ns=self.a.ns)

    def mend(self) -> None:
        ip("link", "set", self.a.dev, "up", ns=self.a.ns)

    def bytes_carried(self) -> int:
        """Bytes a's end of the pair has sent and received."""
        out = ip("-s", "link", "show", "dev", self.a.dev, ns=self.a.ns).splitlines()
        rx = out[out.index(next(x for x in out if x.strip().startswith("RX:"))) + 1]
        tx = out[out.index(next(x for x in out if x.strip().startswith("TX:"))) + 1]
        return int(rx.split()[0]) + int(tx.split()[0])

    def down(self) -> None:
        """Delete both namespaces (and so the pair); errors go on to the next."""
        errors = []
        for ns in self.made:
            try:
                ip("netns", "del", ns)
            except RuntimeError as e:
                errors.append(str(e))
        self.made.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> "Link":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


class NsLoop:
    """An asyncio loop on a daemon thread inside namespace `ns`."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> "NsLoop":
        ready, failed = threading.Event(), []

        def main() -> None:
            try:
                enter(self.ns)
            except OSError as e:
                failed.append(e)
                ready.set()
                return
            loop = self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
                tasks = asyncio.all_tasks(loop)
                for t in tasks:
                    t.cancel()
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

        self.thread = threading.Thread(target=main, name=f"netns-{self.ns}", daemon=True)
        self.thread.start()
        if not ready.wait(10) or failed:
            raise failed[0] if failed else TimeoutError(f"no loop in {self.ns}")
        return self

    async def call(self, fn, *args, timeout: float = 60.0):
        """`fn(*args)` (a coroutine) run on this loop; its result, here."""
        fut = asyncio.run_coroutine_threadsafe(fn(*args), self.loop)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def stop(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(10)


async def listening(host: str, port: int, timeout: float = 10.0) -> None:
    """Until a nats-server answers at host:port (its INFO line), from this loop's
    namespace; a condition polled, not a sleep."""
    end = time.monotonic() + timeout
    while True:
        try:
            r, w = await asyncio.open_connection(host, port)
            try:
                if (await asyncio.wait_for(r.read(4), 1.0)).startswith(b"INFO"):
                    return
            finally:
                w.close()
        except (OSError, asyncio.TimeoutError):
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"nothing listens on {host}:{port}")
        await asyncio.sleep(0.02)
