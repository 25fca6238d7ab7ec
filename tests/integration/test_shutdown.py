"""Stopping `honcho start` (Ctrl-C) on the real Procfile while streams run: honcho
signals every process at once, and the streams already running, over NATS and over
HTTP, still finish; and a decoder worker stopped while it compiles in the background
exits 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import msgspec

from shared import catalog, subjects
from shared.bus import connect
from shared.natsd import free_port
from services.supervisor import Supervisor, wait_ready
from bench.support import orchestration as fleet
from tests.support.stack import wait_until

# Short enough to finish inside honcho's 5 s between its SIGTERM and its SIGKILL even on
# a loaded machine (a stream longer than that grace cannot finish by design), long
# enough that the streams are still running when honcho stops.
TOKENS = 48


async def _stream(nc, started: asyncio.Event, i: int, out: list[bytes]) -> list[bytes]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"model": fleet.DEMO_LM, "prompt": f"Stream {i} says", "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    await nc.publish(subjects.COMPLETIONS, msgspec.json.encode(body), reply=inbox,
                     headers={"Tensorbus-Timeout": "120"})
    while True:
        msg = await sub.next_msg(timeout=120)
        out.append(msg.data)
        started.set()
        if msg.data == b"[DONE]":
            return out


async def _http_stream(url: str, started: asyncio.Event, out: list[bytes]) -> list[bytes]:
    body = {"model": fleet.DEMO_LM, "prompt": "Stream over HTTP says", "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    out.append(line[len("data: "):].encode())
                    started.set()
    return out


async def test_stopping_honcho_lets_running_streams_finish(tmp_path, jax_cache_dir):
    http_port = free_port()
    env = fleet.stack_env(tmp_path, Path(jax_cache_dir), TENSORBUS_FLEET=f"{fleet.DEMO_LM}=1:1",
                          TENSORBUS_DECODE_SLOTS="4", TENSORBUS_MAX_CONTEXT="512",
                          TENSORBUS_HTTP_PORT=str(http_port))
    env.pop("TENSORBUS_MODEL_DIR")
    h = fleet.Honcho(tmp_path, env)
    nc = None
    try:
        nc = await connect(h.url, "shutdown-client")
        await wait_ready(nc, fleet.DEMO_LM, 1, timeout=300)
        started = [asyncio.Event() for _ in range(4)]
        got: list[list[bytes]] = [[] for _ in started]
        streams = [asyncio.create_task(_stream(nc, ev, i, got[i]))
                   for i, ev in enumerate(started[:3])]
        streams.append(asyncio.create_task(  # the last over HTTP (SSE)
            _http_stream(f"http://127.0.0.1:{http_port}", started[3], got[3])))
        for ev in started:
            await ev.wait()
        h.popen.send_signal(signal.SIGINT)  # Ctrl-C: honcho stops every process
        at_stop = [len(g) for g in got]
        results = await asyncio.gather(*streams)
        # The stop really landed mid-way: chunks kept coming after it.
        assert any(len(g) > n for g, n in zip(got, at_stop)), at_stop
        for chunks in results:
            assert chunks[-1] == b"[DONE]"
            bodies = [msgspec.json.decode(c) for c in chunks[:-1]]
            assert not any("error" in b for b in bodies), bodies[-1]
            assert bodies[-2]["choices"][0]["finish_reason"] == "length"
            assert bodies[-1]["usage"]["completion_tokens"] == TOKENS  # every token arrived
        assert await asyncio.to_thread(h.popen.wait, 60) is not None
        assert not h.alive()
    finally:
        if nc is not None:
            await nc.close()
        h.stop()


async def test_a_decoder_worker_stopped_while_it_compiles_exits_cleanly(tmp_path):
    """Ready after its first programs, the worker compiles the rest on a background
    thread; SIGTERM then must still end in exit 0 and a "stopped" line, not an abort
    (a process leaving while XLA compiles on a daemon thread dies of SIGABRT)."""
    with Supervisor(tmp_path, env={"TENSORBUS_COMPILE_AHEAD": "first"}) as sup:
        sup.start_nats()
        worker = sup.start("worker", "services.worker", TENSORBUS_WORKER_ID="w-stop",
                           TENSORBUS_MODEL_DIR=str(catalog.bundled_dir(catalog.DEMO_LM)))
        await wait_until(lambda: '"event": "ready"' in worker.log_path.read_text(), timeout=240,
                         interval=0.05)  # fmt: skip
        assert '"programs_compiled_all"' not in worker.log_path.read_text(), \
            "the background compiles ended before the signal: nothing was tested"
        worker.signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, worker.wait, 120)
        log = worker.log_path.read_text()
        assert code == 0, log[-3000:]
        assert '"event": "stopped"' in log and "exception not rethrown" not in log
