"""Streamed generations under node loss: a three-server cluster, the gateway, the
scheduler and a tiny real GPT-2 decoder worker each on a different member, four HTTP
clients streaming greedy completions in a loop; the server the gateway is on is
SIGKILLed (and restarted), then the worker's, then the scheduler's. Every stream
either arrives whole and equal to transformers' greedy generation on the same
weights, or ends with a clear `stream_broken` (or stall) error chunk after a prefix
of it: never a duplicated or missing token, never a hang (each stream is read
within a bound and must end with [DONE])."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from tests.reliability.nodeload import CLIENTS, lose, member, order
from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 256
NEW = 40
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), [7, 8, 9]]
STALL_S = 3.0  # a stream whose end was lost ends this soon (TENSORBUS_STALL_TIMEOUT_S)
READ_BOUND_S = 30.0  # a stream not ended by then counts as hung
FIGURES: dict[str, dict] = {}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("nl-gpt2")
    model, engine = serve_tiny("gpt2", path, "tiny-nl", CONTEXT)
    # References before any service runs (a torch call in a test would stall the loop).
    refs = {tuple(p): engine.tokenizer.decode(hf_greedy(model, p, NEW)) for p in PROMPTS}
    return engine, str(path), refs


class StreamLoad:
    """CLIENTS clients streaming greedy completions; every stream counted as sent,
    whole (its text the reference's), broken (an error chunk after a prefix of the
    reference), wrong (anything else: a gap, a duplicate, a foreign text) or hung."""

    def __init__(self, http_url: str, model: str, refs: dict) -> None:
        self.http_url, self.model, self.refs = http_url, model, refs
        self.answered: Counter[str] = Counter()  # whole streams, per id
        self.during: Counter[str] = Counter()
        self.broken: list[tuple[str, str, str, int]] = []  # id, phase it ended in, code,
        # characters delivered
        self.wrong: list[tuple[str, str]] = []
        self.hung: list[str] = []
        self.messages: dict[str, str] = {}  # error code -> a message seen with it
        self.phase = "before"
        self._stop = asyncio.Event()

    def total(self) -> int:
        return sum(self.answered.values()) + len(self.broken)

    async def _one(self, http: httpx.AsyncClient, rid: str, prompt: list[int]) -> None:
        at = self.phase
        self.during[at] += 1
        body = {"model": self.model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, error, done = "", None, False
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:  # ended before its first chunk
                err = json.loads(await r.aread())["error"]
                self.broken.append((rid, self.phase, err["code"], 0))
                self.messages[err["code"]] = err["message"]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["code"]
                    self.messages[error] = chunk["error"]["message"]
                else:
                    text += "".join(c["text"] for c in chunk["choices"])
        ref = self.refs[tuple(prompt)]
        if not done:
            self.wrong.append((rid, "no [DONE]"))
        elif error is None and text == ref:
            self.answered[rid] += 1
        elif error is not None and ref.startswith(text):
            self.broken.append((rid, self.phase, error, len(text)))
        else:
            self.wrong.append((rid, f"{error}: {text!r} against {ref!r}"))

    async def _client(self, http: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            rid = f"st-{n}-{i}"
            try:
                await asyncio.wait_for(self._one(http, rid, PROMPTS[(n + i) % len(PROMPTS)]),
                                       READ_BOUND_S)
            except TimeoutError:
                self.hung.append(rid)
            except httpx.HTTPError as exc:
                self.broken.append((rid, self.phase, type(exc).__name__, 0))
            i += 1

    async def run(self, body) -> None:
        async with httpx.AsyncClient(base_url=self.http_url, timeout=READ_BOUND_S) as http:
            tasks = [asyncio.create_task(self._client(http, n)) for n in range(CLIENTS)]
            try:
                await body()
            finally:
                self._stop.set()
                await asyncio.gather(*tasks)


async def test_streams_under_node_loss_end_whole_or_clearly(cluster, decoder):
    engine, path, refs = decoder
    async with running_stack(cluster.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=4, stall_timeout_s=STALL_S,
                             urls={"gateway": order(cluster, 0), "scheduler": order(cluster, 1),
                                   "client": order(cluster, 2)}) as st:
        worker = await st.add_worker(engine, "dec-nl", kind="decoder", url=order(cluster, 2))
        services = {"gateway": st.gateway.nc, "scheduler": st.scheduler.nc, "worker": worker.nc}
        conns = [*services.values(), st.client]
        load = StreamLoad(st.http_url, engine.name, refs)

        async def losses() -> None:
            for name in ("gateway", "worker", "scheduler"):
                scenario = f"{name}'s server"
                victim = member(cluster, services[name])
                on_it = [n for n, nc in services.items() if member(cluster, nc) == victim]
                resumed = st.gateway.front.resumed
                recovered, _ = await lose(cluster, victim, load, scenario, conns)
                FIGURES[scenario] = {"resumed": st.gateway.front.resumed - resumed,
                    "recovered_s": round(recovered, 2), "sent_during": load.during[scenario],
                    "broken": sum(1 for b in load.broken if b[1] == scenario),
                    "services_on_it": on_it}
        await load.run(losses)

        print("node loss, streams:", FIGURES, "streams", sum(load.during.values()), "whole",
              sum(load.answered.values()), "broken", load.broken,
              load.messages)
        assert load.wrong == [] and load.hung == [], (load.wrong, load.hung)
        assert all(n == 1 for n in load.answered.values())
        assert all(code in ("stream_broken", "deadline_exceeded") for _, _, code, _ in load.broken), \
            load.broken
        assert load.during["before"] and sum(load.answered.values()) > 3 * 2 * CLIENTS
        sched = st.scheduler
        await wait_until(lambda: not sched.outstanding, timeout=STALL_S + 10)
