"""A/B and canary you can act on: a real nats-server, the real registry, the real
telemetry service; mock encoders whose vectors carry the version that computed them.

- One user keeps one version (OpenAI's `user` field, or the Tensorbus-User header).
- A canary with automatic rollback that fails, or is slow, under load is cleared by
  the telemetry service, and the alias history says why, with the figures.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec

from services.gateway.frontend import USER_HEADER
from services.gateway.codec import VERSION_HEADER
from services.registry.routing import user_point
from shared import subjects
from shared.errors import HEADER_CODE
from shared.registry import CanaryGuard
from tests.support.swap import Built, Load, TaggedEncoder, hb, model_name, push_versions
from tests.support.stack import running_stack, wait_until
from tests.support.telemetry import running_telemetry


class FailingEncoder(TaggedEncoder):
    """A broken release: every batch raises."""

    def embed(self, inputs):
        raise RuntimeError("broken release")


class Release(Built):
    """Version 1 as it should be, version 2 built by `canary_cls`."""

    def __init__(self, canary_cls) -> None:
        super().__init__()
        self.canary_cls = canary_cls

    def __call__(self, info, version):
        engine = (self.canary_cls if version == "2" else TaggedEncoder)(info.name, version)
        self.engines[version] = engine
        return engine


async def embed_as(nc, model: str, user: str = "", header: str = "") -> tuple[int, str]:
    body = {"model": model, "input": ["hello"]}
    if user:
        body["user"] = user
    msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(body), timeout=10,
                           headers={USER_HEADER: header} if header else None)
    h = msg.headers or {}
    return int(h.get(HEADER_CODE, 200)), h.get(VERSION_HEADER, "")


async def serving(st, name: str, factory, worker_id: str, canary: str = "2") -> None:
    await push_versions(st.registry, st.cache_dir / "push", name, 2)
    await st.registry.promote(name, "1")
    await st.add_registry_worker(name, factory, worker_id)
    await wait_until(lambda: hb(st, worker_id).versions == ["1"], timeout=10)


async def test_one_user_keeps_one_version(nats_server):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await serving(st, name, Built(), "sticky-w1")
        await st.registry.canary(name, "2", 0.5)
        await wait_until(lambda: hb(st, "sticky-w1").versions == ["1", "2"], timeout=10)
        await st.scheduler.aliases.wait_for(name, lambda a: a.canary == "2")
        users = [f"user-{i}" for i in range(24)]
        seen: dict[str, set[str]] = {u: set() for u in users}
        for _ in range(4):
            replies = await asyncio.gather(*(embed_as(st.client, name, user=u) for u in users))
            for u, (code, version) in zip(users, replies):
                assert code == 200
                seen[u].add(version)
        assert all(len(v) == 1 for v in seen.values()), seen  # one user, one version
        # The draw is the user's fixed point against the weight, in every scheduler.
        assert {u: v.pop() for u, v in seen.items()} == {
            u: "2" if user_point(u, "2") < 0.5 else "1" for u in users}
        # The header does the same for clients that cannot set `user`.
        by_header = {await embed_as(st.client, name, header="carol") for _ in range(8)}
        assert by_header == {(200, "2" if user_point("carol", "2") < 0.5 else "1")}
        # And over HTTP.
        async with httpx.AsyncClient(base_url=st.http_url, timeout=10) as http:
            over_http = set()
            for _ in range(8):
                r = await http.post("/v1/embeddings", json={"model": name, "input": ["hi"]},
                                    headers={USER_HEADER: "dave"})
                over_http.add((r.status_code, r.headers.get(VERSION_HEADER)))
        assert over_http == {(200, "2" if user_point("dave", "2") < 0.5 else "1")}
        # Without a user, each request draws on its own: both versions show.
        anonymous = {v for _, v in await asyncio.gather(
            *(embed_as(st.client, name) for _ in range(40)))}
        assert anonymous == {"1", "2"}


async def rolled_back(st, name: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        a = await st.registry.aliases(name)
        if a.change == "auto-rollback":
            return a
        assert a.canary == "2", f"the canary changed otherwise: {a}"
        assert time.monotonic() < end, "the canary was not rolled back"
        await asyncio.sleep(0.1)


async def test_a_failing_guarded_canary_is_rolled_back_under_load(nats_server):
    """(A slow canary is judged by the same code on p95, tests/services/test_canary_guard.py:
    here one engine thread runs both versions, so a slow canary slows prod too.)"""
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st, \
            running_telemetry(nats_server.url, registry=True):
        await serving(st, name, Release(FailingEncoder), "guard-w1")
        guard = CanaryGuard(window_s=10.0, min_requests=15, error_margin=0.2, p95_margin=1.0)
        async with Load(st.client, name, clients=6) as load:
            await load.until(lambda r: len(r) >= 20)  # prod alone, warm
            await st.registry.canary(name, "2", 0.3, guard)
            a = await rolled_back(st, name)
            assert (a.prod, a.canary, a.guard) == ("1", "", None)
            assert a.reason.startswith("error rate 100.0% vs prod 0.0%"), a.reason
            f = a.figures
            assert f["canary_requests"] >= 15 and f["prod_requests"] > f["canary_requests"]
            assert (f["canary_error_rate"], f["prod_error_rate"]) == (1.0, 0.0)
            assert 0 < f["window_s"] <= 10.0
            # The canary's errors name the version that failed them.
            assert {(r.code, r.version) for r in load.replies} == {(200, "1"), (500, "2")}
            # The gateway and the scheduler follow: every request sent from then on is
            # served by prod (one sent before may still be answered by the canary).
            rolled = lambda x: x.change == "auto-rollback"  # noqa: E731
            await st.scheduler.aliases.wait_for(name, rolled)
            await st.gateway.front.models.resolver.aliases.wait_for(name, rolled)
            mark = time.monotonic()
            after = lambda r: [x for x in r if x.sent > mark]  # noqa: E731
            await load.until(lambda r: len(after(r)) >= 40)
            assert {(r.code, r.version) for r in after(load.replies)} == {(200, "1")}
        [last] = (await st.registry.alias_history(name))[-1:]
        assert (last.change, last.reason, last.figures) == ("auto-rollback", a.reason, a.figures)
