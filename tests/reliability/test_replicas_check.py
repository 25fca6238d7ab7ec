"""A stream kept on fewer servers than configured is reported at start-up.

A deployment first run on one server (or before TENSORBUS_JS_REPLICAS was set) left
R1 streams; moved to a cluster configured for R3, they would still die with their one
server. The services bind the existing streams, so shared.jetstream.check_replicas
warns, naming the fix. Against a real nats-server; R3 cannot be created on a lone
server, which is exactly the R1 stream such a deployment already has.
"""

from __future__ import annotations

from nats.js.api import StreamConfig
from structlog.testing import capture_logs

from services.registry.store import Registry
from shared import subjects
from shared.jetstream import check_replicas

META = f"KV_{subjects.REGISTRY_META}"


async def test_an_r1_stream_with_r3_configured_is_warned_about(nc, monkeypatch):
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="REPLICAS_R1", subjects=["replicas-r1.>"],
                                     num_replicas=1))
    try:
        with capture_logs() as logs:
            low = await check_replicas(nc, ("REPLICAS_R1", "REPLICAS_MISSING"), setting=3)
        assert low == {"REPLICAS_R1": 1}
        (warning,) = [e for e in logs if e["event"] == "js_replicas_below_configured"]
        assert warning["log_level"] == "warning"
        assert warning | {"stream": "REPLICAS_R1", "replicas": 1, "configured": 3} == warning
        assert warning["fix"] == "tensorbus replicas 3"

        with capture_logs() as logs:  # as many as configured: nothing to say
            assert await check_replicas(nc, ("REPLICAS_R1",), setting=1) == {}
        assert not [e for e in logs if e["event"] == "js_replicas_below_configured"]
    finally:
        await js.delete_stream("REPLICAS_R1")


async def test_the_registry_warns_when_it_opens_r1_buckets_configured_for_r3(nc, monkeypatch):
    monkeypatch.delenv("TENSORBUS_JS_REPLICAS", raising=False)
    await Registry.open(nc)  # on one server: created R1
    assert (await nc.jetstream().stream_info(META)).config.num_replicas in (None, 1)
    monkeypatch.setenv("TENSORBUS_JS_REPLICAS", "3")  # the Kubernetes ConfigMap's setting
    with capture_logs() as logs:
        await Registry.open(nc)
    warned = {e["stream"] for e in logs if e["event"] == "js_replicas_below_configured"}
    assert META in warned and f"OBJ_{subjects.REGISTRY_OBJECTS}" in warned
