"""JetStream's leaders lost under load: a three-server cluster (each server with its
monitoring port, where /jsz names the meta leader), the gateway, the scheduler and a
real encoder worker each on a different member, the TELEMETRY stream and the
registry on all three, a steady load of embeddings requests over HTTP. The server
leading JetStream's meta group is SIGKILLed (and restarted), then the one leading the
registry's KV stream; right after each kill a registry push and a promote start,
during the election. Counted: every request answered once and none failed, the push
and the promote succeed after the election, every request's record stored once."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from services.registry.store import Registry
from services.telemetry.stream import ensure_stream, stream_config
from shared.bus import close
from shared.jetstream import STREAMS
from shared.natsd import NatsCluster, free_port
from tests.reliability.nodeload import TEXTS, Load, lose, member, order, stored_records
from tests.reliability.test_cluster import KV_STREAM, tiny_model
from tests.support.cluster import js_ready, until
from tests.support.stack import running_stack, wait_until

FIGURES: dict[str, dict] = {}  # per scenario, for docs/benchmarks.md


@pytest.fixture
async def cluster(tmp_path):
    """A formed cluster with monitoring, the TELEMETRY stream and the registry (a
    version 1 of a tiny model, promoted) on all three members."""
    c = NatsCluster(tmp_path / "nats", 3)
    c.monitor = [free_port() for _ in c.servers]
    for server, port in zip(c.servers, c.monitor):
        server.extra = [*server.extra, "-m", str(port)]
    with c.start(die_with_parent=True):
        nc = await js_ready(c.url)
        try:
            await until(lambda: ensure_stream(nc.jetstream(), stream_config(), 3))
            reg = await until(lambda: Registry.open(nc, actor="ci@test"))
            await reg.promote("tiny", (await reg.push(tiny_model(tmp_path), "tiny",
                                                      progress=False)).version)
        finally:
            await close(nc)
        yield c


def meta_leader(cluster: NatsCluster) -> int:
    """The member leading JetStream's meta group, as a live member's /jsz says."""
    for server, port in zip(cluster.servers, cluster.monitor):
        if server.proc is not None and server.proc.poll() is None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=5) as r:
                leader = json.load(r)["meta_cluster"]["leader"]
            return int(leader.rsplit("-", 1)[1])
    raise AssertionError("no live member")


async def all_current(js) -> bool:
    """Every tensorbus stream led, with both followers current (a restarted member
    caught up): safe to lose another member."""
    for name in STREAMS:
        c = (await js.stream_info(name)).cluster
        if not c.leader or len(c.replicas or []) != 2 or not all(p.current for p in c.replicas):
            return False
    return True


async def test_losing_jetstreams_leaders_under_load(cluster, tmp_path, minilm,
                                                   sentence_transformer):
    src = tiny_model(tmp_path)
    async with running_stack(cluster.url, urls={"gateway": order(cluster, 0),
                                                "scheduler": order(cluster, 1),
                                                "client": order(cluster, 2)}) as st:
        worker = await st.add_worker(minilm, "enc-js", url=order(cluster, 2))
        conns = [st.gateway.nc, st.scheduler.nc, worker.nc, st.client]
        reg = await Registry.open(st.client, actor="ci@test")
        js = st.client.jetstream()
        expected = sentence_transformer.encode(TEXTS, normalize_embeddings=True)  # the reference
        load = Load(st.http_url, expected, "nj")

        async def push_and_promote() -> dict:
            """A push and a promote started during the election, timed."""
            started = time.monotonic()
            mv = await reg.push(src, "tiny", progress=False)
            pushed = time.monotonic() - started
            await reg.promote("tiny", mv.version)
            return {"version": mv.version, "push_s": round(pushed, 2),
                    "push_and_promote_s": round(time.monotonic() - started, 2)}

        async with load.running():
            for scenario in ("meta leader", "registry stream leader"):
                await until(lambda: _checked(all_current(js)), timeout=60)
                if scenario == "meta leader":
                    victim = meta_leader(cluster)
                else:
                    leader = (await js.stream_info(KV_STREAM)).cluster.leader
                    victim = int(leader.rsplit("-", 1)[1])
                on_victim = [n for n, nc in zip(("gateway", "scheduler", "worker", "client"),
                                                conns) if member(cluster, nc) == victim]
                recovered, reg_figures = await lose(cluster, victim, load, scenario, conns,
                                                    during=push_and_promote)
                FIGURES[scenario] = {"recovered_s": round(recovered, 2),
                                     "sent_during": load.during[scenario],
                                     "services_on_it": on_victim, **reg_figures}

        print("node loss, JetStream:", FIGURES, "sent", sum(load.sent.values()), "failed",
              len(load.failed), "records retried", st.gateway.front.recorder.retried)
        load.check()
        # both pushes became versions 2 and 3, ready; the last promote holds
        assert [v.version for v in await reg.versions("tiny")] == ["1", "2", "3"]
        assert (await reg.aliases("tiny")).prod == "3"
        sched = st.scheduler
        await wait_until(lambda: not sched.outstanding, timeout=10)
        records = await stored_records(cluster.url, len(load.answered), "nj")
        assert records == load.answered, set(records) ^ set(load.answered)
        assert st.gateway.front.recorder.lost == 0


async def _checked(condition) -> None:
    """For `until`: raise until the awaited condition holds."""
    assert await condition
