"""A real Prometheus server for tests: Debian's `/usr/bin/prometheus` (scripts/test.sh
installs it), on a free loopback port, with a temporary config and storage directory,
scraping the given `/metrics` targets every `interval_s`.

`query()` runs PromQL over the HTTP API exactly as Grafana or KEDA would; `wait_for()`
polls a query until its result satisfies a condition (no sleeps)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import httpx

from shared.natsd import free_port

BINARY = os.environ.get("TENSORBUS_PROMETHEUS", "/usr/bin/prometheus")


def binary() -> str:
    path = BINARY if Path(BINARY).exists() else shutil.which("prometheus")
    if not path:
        raise RuntimeError(f"{BINARY} not found: scripts/test.sh installs Debian's "
                           "`prometheus` package (apt-get install prometheus)")
    return path


class Prometheus:
    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http

    async def query(self, promql: str) -> list[dict]:
        """An instant query; the `result` list (one entry per series)."""
        resp = await self.http.get(f"{self.url}/api/v1/query", params={"query": promql})
        body = resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"PromQL {promql!r} failed: {body.get('error', body)}")
        return body["data"]["result"]

    async def wait_for(self, promql: str, cond: Callable[[list[dict]], bool],
                       timeout: float = 30.0) -> list[dict]:
        end = time.monotonic() + timeout
        while True:
            result = await self.query(promql)
            if cond(result):
                return result
            if time.monotonic() > end:
                raise AssertionError(f"{promql!r}: condition not met in {timeout}s; "
                                     f"last result {result}")
            await asyncio.sleep(0.2)

    async def targets_up(self) -> bool:
        resp = await self.http.get(f"{self.url}/api/v1/targets")
        active = resp.json()["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


def scrape_config(targets: list[str], interval_s: float) -> str:
    ms = max(int(interval_s * 1000), 100)
    listed = ", ".join(f'"{t}"' for t in targets)
    return (f"global:\n  scrape_interval: {ms}ms\n  scrape_timeout: {ms}ms\n"
            f"  evaluation_interval: {ms}ms\n"
            f"scrape_configs:\n  - job_name: telemetry\n"
            f"    static_configs:\n      - targets: [{listed}]\n")


@asynccontextmanager
async def running_prometheus(targets: list[str], interval_s: float = 0.5,
                             timeout: float = 60.0) -> AsyncIterator[Prometheus]:
    """Start Prometheus scraping `targets` (host:port), wait until it is ready and has
    scraped every target once; stop it and remove its storage afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="tensorbus-prometheus-"))
    (workdir / "prometheus.yml").write_text(scrape_config(targets, interval_s))
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary(), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            prom = Prometheus(f"http://127.0.0.1:{port}", http)
            end = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("prometheus exited: "
                                       + (workdir / "prometheus.log").read_text()[-2000:])
                try:
                    ready = (await http.get(f"{prom.url}/-/ready")).status_code == 200
                    if ready and await prom.targets_up():
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > end:
                    raise TimeoutError("prometheus not ready / targets not scraped in time")
                await asyncio.sleep(0.1)
            yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
