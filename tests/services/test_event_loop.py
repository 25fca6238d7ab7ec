"""TENSORBUS_EVENT_LOOP: every service's event loop, chosen in services.lifecycle.serve.

The subprocess tests run the real gateway (`python -m services.gateway`): on uvloop it
says so in its `event_loop` log line, answers over NATS and HTTP (uvicorn's h11 parser
on uvloop's transports, the header limit included) and stops cleanly on SIGTERM; a loop
that does not exist is a configuration error (exit 78)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.lifecycle import loop_factory, run_loop
from services.micro import ready_subject
from shared.config import EX_CONFIG

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway(nats_url: str, loop: str, port: int = 0) -> subprocess.Popen:
    env = {**os.environ, "TENSORBUS_NATS_URL": nats_url, "TENSORBUS_LOG_FORMAT": "json",
           "TENSORBUS_LOG_LEVEL": "info", "TENSORBUS_EVENT_LOOP": loop,
           "TENSORBUS_HTTP_PORT": str(port or _free_port())}
    return subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)


def _events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


async def test_a_service_started_on_uvloop_runs_on_it_and_answers(nats_server, nc):
    port = _free_port()
    proc = _gateway(nats_server.url, "uvloop", port)
    lines: list[str] = []

    def started() -> bool:  # the gateway's own line, logged once it listens and is ready
        for line in proc.stderr:
            lines.append(line)
            if '"gateway_started"' in line:
                return True
        return False  # it exited first

    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            up = await asyncio.wait_for(asyncio.to_thread(started), 60)
            assert up and proc.poll() is None, "".join(lines)
            r = await http.get("/readyz")
            assert r.status_code == 200 and r.json() == {"ready": True}
            msg = await nc.request(ready_subject("tensorbus-gateway"), b"", timeout=10)
            assert json.loads(msg.data)["status"] == "ok"  # and over NATS
            try:  # the header limits still hold on uvloop
                r = await http.post("/v1/embeddings", json={"model": "m", "input": "x"},
                                    headers={f"x-junk-{i}": "v" * 16 for i in range(3000)})
                # 400 from h11 when the block arrives in pieces; 431 from the gateway's
                # own check when it arrives whole (as on asyncio's loop)
                assert r.status_code in (400, 431), r.status_code
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                pass  # h11 may answer and close while the block is still being sent
            r = await http.get("/v1/models")
            assert r.status_code == 200 and r.json()["object"] == "list"
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        stderr = "".join(lines) + proc.stderr.read()
        assert rc == 0, stderr
        loops = [e for e in _events(stderr) if e["event"] == "event_loop"]
        assert [(e["loop"], e["setting"]) for e in loops] == [("uvloop", "uvloop")], stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_an_unknown_event_loop_exits_78_with_the_setting_named(nats_server):
    proc = _gateway(nats_server.url, "bogus")
    try:
        rc = await asyncio.to_thread(proc.wait, 60)
        stderr = proc.stderr.read()
        assert rc == EX_CONFIG == 78, stderr
        assert "TENSORBUS_EVENT_LOOP='bogus'" in stderr and "uvloop" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_auto_takes_uvloop_when_installed_and_asyncio_takes_asyncio():
    import uvloop  # a dependency of the project on Linux and macOS

    assert loop_factory("auto") == ("uvloop", uvloop.new_event_loop)
    assert loop_factory("uvloop") == ("uvloop", uvloop.new_event_loop)
    assert loop_factory("asyncio") == ("asyncio", asyncio.new_event_loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory("auto") == ("asyncio", asyncio.new_event_loop)
    with pytest.raises(SystemExit) as exc:
        loop_factory("uvloop")
    assert exc.value.code == EX_CONFIG
    assert "uvloop is not installed" in capsys.readouterr().err


def test_run_loop_runs_the_coroutine_on_the_loop_asked_for():
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.partition(".")[0]

    assert run_loop(which(), "asyncio") == "asyncio"
    assert run_loop(which(), "uvloop") == "uvloop"
    with pytest.raises(SystemExit):
        run_loop(which(), "bogus")  # closed unstarted: no "never awaited" warning
