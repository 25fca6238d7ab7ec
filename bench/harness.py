"""What the benchmark scripts share: arguments, the stack, percentiles, output, figure rows.

Each script in bench/ is one measurement with its own command line; what they all
repeat lives here:

  1. arguments: `parser(doc)` (the script's docstring as its `--help`), `csv_ints`,
     `csv_floats`, `csv_strs` for comma-separated lists;
  2. the stack: `service_env(...)` and `start_stack(sup, ...)` start nats-server,
     gateways, scheduler, telemetry and workers as processes (services/supervisor.py,
     which ties each one to this process); `running(...)` does the same as an async
     context that also connects a client and waits for the workers to be ready;
     `seed_jax_cache` copies the suite's compiled buckets into a fresh data dir;
  3. measuring: `pct_ms` and `percentiles` (milliseconds from seconds), the CPU
     seconds of a process (`cpu_s`) and of a whole stack (`cpu_all`, `per_request`),
     resident memory (`rss_mb`, `memory`), `run_info()` (date, machine, load
     average) for every result;
  4. output: `write_json(name, result)` under bench/out/;
  5. figure rows: `figure_row(...)` prints one row of docs/benchmarks.md's tables
     (figure, value, command, date, plot).

What the tests use as well (load generators, request inputs, the fault and
orchestrator scenarios, tiny models) lives in bench/support/, which the tests import;
bench/ never imports tests/.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from bench.support.stats import pct_ms

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"

__all__ = ["REPO", "OUT", "parser", "csv_ints", "csv_floats", "csv_strs", "service_env",
           "start_stack", "seed_jax_cache", "running", "pct_ms", "percentiles", "cpu_s",
           "cpu_all", "per_request", "rss_mb", "memory", "run_info", "write_json",
           "figure_row"]


# ---------------------------------------------------------------- 1. arguments
def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser whose `--help` opens with the script's docstring."""
    return argparse.ArgumentParser(description=doc, **kwargs,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def csv_strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in csv_strs(text)]


def csv_floats(text: str) -> list[float]:
    return [float(x) for x in csv_strs(text)]


# ---------------------------------------------------------------- 2. the stack
def service_env(model: str | None = None, *, http_port: int = -1, log_level: str = "warning",
                **extra: str) -> dict[str, str]:
    """Environment of every service of a bench stack: no HTTP port unless asked for, no
    metrics port, quiet logs; `model` is also the gateway's tokenizer (the bundled
    files, so nothing is downloaded)."""
    env = {"TENSORBUS_HTTP_PORT": str(http_port), "TENSORBUS_METRICS_PORT": "0",
           "TENSORBUS_LOG_LEVEL": log_level}
    if model is not None:
        from shared import catalog

        env["TENSORBUS_MODEL"] = model
        bundled = catalog.bundled_dir(model)
        if bundled is not None:
            env["TENSORBUS_MODEL_DIR"] = str(bundled)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_stack(sup, *, nats: bool = True, gateways: int = 1, scheduler: bool = True,
                telemetry: bool = True, workers: Mapping[str, Mapping[str, str]] | None = None,
                worker_module: str = "services.worker", **env: str) -> None:
    """nats-server (unless `nats` is False: already running), then `gateways` gateways
    (named gateway, gateway2, ...), the scheduler, telemetry, and one worker per entry
    of `workers` (name -> its own environment; TENSORBUS_WORKER_ID defaults to the
    name). `env` goes to every one."""
    if nats:
        sup.start_nats()
    for i in range(gateways):
        sup.start("gateway" if i == 0 else f"gateway{i + 1}", "services.gateway", **env)
    if scheduler:
        sup.start("scheduler", "services.scheduler", **env)
    if telemetry:
        sup.start("telemetry", "services.telemetry", **env)
    for name, wenv in (workers or {}).items():
        sup.start(name, worker_module, **{"TENSORBUS_WORKER_ID": name, **env, **wenv})


def seed_jax_cache(data_dir: Path) -> None:
    """Give a fresh data dir the buckets compiled by earlier runs, if there are any: a
    copy of the test suite's compilation cache (`TENSORBUS_TEST_CACHE`)."""
    from bench.support.orchestration import default_cache

    cache, dest = default_cache(), data_dir / "jax-cache"
    if cache.is_dir() and not dest.is_dir():
        shutil.copytree(cache, dest)


@asynccontextmanager
async def running(workdir: Path, model: str, *, sup_env: Mapping[str, str] | None = None,
                  ready_timeout: float = 600.0, client_name: str = "bench-client", **stack):
    """(supervisor, client): `start_stack(**stack)` under a Supervisor of `workdir`,
    a client connected, and as many workers of `model` ready as `workers` names."""
    from services.supervisor import Supervisor, wait_ready
    from shared.bus import connect

    with Supervisor(workdir, env=dict(sup_env or {})) as sup:
        start_stack(sup, **stack)
        nc = await connect(sup.nats_url, client_name)
        try:
            await wait_ready(nc, model, max(len(stack.get("workers") or {}), 1),
                             timeout=ready_timeout)
            yield sup, nc
        finally:
            await nc.close()


# ---------------------------------------------------------------- 3. measuring
def percentiles(lat_s: Iterable[float], qs: Iterable[float] = (50, 99),
                digits: int | None = None) -> dict[str, float]:
    """{"p50_ms": ..., "p99_ms": ...} of latencies in seconds (NaN when there are none)."""
    a = np.asarray(list(lat_s), dtype=np.float64)
    return {f"p{q:g}_ms": pct_ms(a, q, digits) for q in qs}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (NaN once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def cpu_all(sup, client_pid: int | None = None) -> dict[str, float]:
    """CPU seconds of every process of a stack, nats-server's and the client's too
    (this process unless `client_pid` names another, such as wrk)."""
    out = {name: cpu_s(p.popen.pid) for name, p in sup.procs.items()}
    out["nats-server"] = cpu_s(sup.nats.proc.pid)
    out["client"] = cpu_s(os.getpid() if client_pid is None else client_pid)
    return out


def per_request(before: dict, after: dict, n: int) -> dict[str, float]:
    """CPU milliseconds per answered request, per process."""
    return {k: round((after[k] - before[k]) * 1000 / max(n, 1), 3) for k in before}


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (NaN once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


def memory(sup) -> dict[str, float]:
    """Resident MB of every process of a stack, nats-server's too."""
    out = {name: rss_mb(p.popen.pid) for name, p in sup.procs.items()}
    out["nats-server"] = rss_mb(sup.nats.proc.pid)
    return out


def run_info(command: str | None = None) -> dict:
    """What every result records: when (UTC), on what, under which load."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
            "load_average_1m": round(os.getloadavg()[0], 2)}
    if command is not None:
        info["command"] = command
    return info


# ---------------------------------------------------------------- 4. output
def write_json(name: str | Path, result, *, out_dir: Path = OUT) -> Path:
    """Write `result` as indented JSON to bench/out/<name> (or to `name` itself when it
    is a path with a directory); return the path."""
    import json

    path = Path(name)
    if path.parent == Path("."):
        path = out_dir / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path


# ---------------------------------------------------------------- 5. figure rows
FIGURE_HEADER = "| figure | value | command | date (UTC) |\n|---|---|---|---|"


def figure_row(figure: str, value: str, command: str, date: str | None = None,
               plot: str | None = None) -> str:
    """One row of a docs/benchmarks.md table: figure, value, `command`, date, and the
    plot (docs/img/...) when there is one, after the date."""
    date = date or time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    cells = [figure, value, f"`{command}`", date + (f"; ![plot]({plot})" if plot else "")]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
