"""Each role of deploy/nats/auth.conf can do its job on the bus and nothing more.

A denied publish or subscribe is proven by the server's `Permissions Violation`
error (nats-py's error_cb), awaited as an event; an allowed path is proven by the
message arriving, and by a PING/PONG round trip that brings no violation with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import msgspec
import nats
import nats.errors
import pytest
from nats.js.api import KeyValueConfig

from services.micro import ServiceHealth, add_service, ready_subject
from shared import messages, subjects
from shared.telemetry import Heartbeat, encode as encode_record, record_decoder

KV_STREAM = f"KV_{subjects.REGISTRY_META}"
OBJ_STREAM = f"OBJ_{subjects.REGISTRY_OBJECTS}"
ALIAS_KEY = "alias.all-MiniLM-L6-v2.prod"


async def next_msg(sub, timeout: float = 30.0):
    # A bound, not a wait: a message allowed through arrives at once on a quiet
    # machine; one loaded run took longer than 10 s to deliver one.
    return await sub.next_msg(timeout=timeout)


# --- authentication ---------------------------------------------------------


async def test_every_role_logs_in_with_its_own_password_only(bus):
    for role in bus.passwords:
        r = await bus.connect(role)
        await r.assert_clean()
    for role, password in (("worker", bus.passwords["deploy"]), ("deploy", "tbguess")):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await bus.connect(role, password=password)


# --- client <-> gateway -----------------------------------------------------
# Clients connect after the gateway's subscription is flushed: a client already
# connected sees interest behind a service import a few milliseconds late, and
# would get a no-responders status in that window.


async def test_client_request_is_answered_by_a_gateway_role_responder(bus):
    gateway = await bus.connect("gateway")

    async def answer(msg):
        body = json.loads(msg.data)
        await msg.respond(json.dumps({"object": "list", "echo": body["input"]}).encode())

    await gateway.nc.subscribe(subjects.EMBEDDINGS, queue=subjects.QUEUE_GATEWAY, cb=answer)
    await gateway.nc.flush()
    client = await bus.connect("client")

    req = {"model": "all-MiniLM-L6-v2", "input": ["hello"]}
    reply = await client.nc.request(subjects.EMBEDDINGS, json.dumps(req).encode(), timeout=10)
    assert json.loads(reply.data) == {"object": "list", "echo": ["hello"]}
    await gateway.assert_clean()
    await client.assert_clean()


async def test_a_streamed_reply_reaches_the_client_chunk_by_chunk(bus):
    # allow_responses {max: -1} on the gateway and response_type stream on the
    # export are what let one request carry many chunks and the final [DONE].
    gateway = await bus.connect("gateway")
    chunks = [json.dumps({"choices": [{"index": 0, "text": t}]}).encode() for t in "abc"]

    async def stream(msg):
        for c in chunks:
            await gateway.nc.publish(msg.reply, c)
        await gateway.nc.publish(msg.reply, b"[DONE]")

    await gateway.nc.subscribe(subjects.COMPLETIONS, queue=subjects.QUEUE_GATEWAY, cb=stream)
    await gateway.nc.flush()
    client = await bus.connect("client")

    inbox = client.nc.new_inbox()
    sub = await client.nc.subscribe(inbox)
    await client.nc.publish(subjects.COMPLETIONS, b'{"stream": true}', reply=inbox)
    got = [(await next_msg(sub)).data for _ in range(len(chunks) + 1)]
    assert got == chunks + [b"[DONE]"]
    await gateway.assert_clean()


async def test_client_reaches_nothing_but_the_public_api(bus):
    client = await bus.connect("client")
    for subject in (subjects.SCHED_SUBMIT, subjects.CANCEL, subjects.worker_work("w1"),
                    subjects.TELEMETRY_REQUESTS, f"$KV.{subjects.REGISTRY_META}.{ALIAS_KEY}",
                    "$JS.API.INFO"):
        await client.nc.publish(subject, b"x")
        await client.violations.wait("Publish", subject)
    # Nor may it pose as the service or listen to internal traffic.
    for subject in (subjects.EMBEDDINGS, "tensorbus.v1.>", subjects.TELEMETRY_ALL):
        await client.nc.subscribe(subject)
        await client.violations.wait("Subscription", subject)


async def test_service_inboxes_are_invisible_to_clients(bus):
    # Clients sit in their own account: a client listening on every inbox still
    # never sees results a worker sends to the gateway's inboxes.
    gateway = await bus.connect("gateway")
    worker = await bus.connect("worker")

    async def answer(msg):
        await msg.respond(b"public")

    await gateway.nc.subscribe(subjects.MODELS, cb=answer)
    await gateway.nc.flush()
    client = await bus.connect("client")
    snoop = await client.nc.subscribe("_INBOX.>")
    await client.nc.flush()

    gw_inbox = gateway.nc.new_inbox()
    gw_sub = await gateway.nc.subscribe(gw_inbox)
    await gateway.nc.flush()
    await worker.nc.publish(gw_inbox, b"secret embedding")
    await worker.nc.flush()
    assert (await next_msg(gw_sub)).data == b"secret embedding"

    # Something the client may see, published after the secret: if the secret
    # had been delivered it would be queued in front of this one.
    await client.nc.publish(subjects.MODELS, b"{}", reply=client.nc.new_inbox() + ".m")
    assert (await next_msg(snoop)).data == b"public"


# --- gateway -> scheduler -> worker -> gateway ----------------------------------


async def test_dispatch_path_works_and_each_hop_is_one_role(bus):
    gateway = await bus.connect("gateway")
    scheduler = await bus.connect("scheduler")
    worker = await bus.connect("worker")

    submits = await scheduler.nc.subscribe(subjects.SCHED_SUBMIT, queue=subjects.QUEUE_SCHEDULER)
    work = await worker.nc.subscribe(subjects.worker_work("w1"))
    done = await scheduler.nc.subscribe(subjects.sched_done("s1"))
    await scheduler.nc.flush()
    await worker.nc.flush()

    result_inbox = gateway.nc.new_inbox()
    results = await gateway.nc.subscribe(result_inbox)
    await gateway.nc.flush()
    req = messages.EmbedWork("r1", "all-MiniLM-L6-v2", "", [[101, 102]], 0.0, result_inbox)
    await gateway.nc.publish(subjects.SCHED_SUBMIT, messages.encode(req))

    submitted = await next_msg(submits)
    await scheduler.nc.publish(subjects.worker_work("w1"), submitted.data)
    await scheduler.nc.publish(result_inbox, messages.encode(messages.Accepted("r1", "w1")))

    job = messages.work_decoder.decode((await next_msg(work)).data)
    res = messages.WorkError(job.request_id, 500, "test", worker_id="w1")
    await worker.nc.publish(job.reply, messages.encode(res))
    await worker.nc.publish(subjects.sched_done("s1"), messages.encode(messages.WorkDone("w1", ["r1"])))

    got = [messages.result_decoder.decode((await next_msg(results)).data) for _ in range(2)]
    assert {type(m) for m in got} == {messages.Accepted, messages.WorkError}
    assert messages.done_decoder.decode((await next_msg(done)).data).request_ids == ["r1"]
    for r in (gateway, scheduler, worker):
        await r.assert_clean()

    # The hops cannot be skipped: the gateway does not dispatch, a worker does
    # not submit, and nobody but the gateway takes public requests.
    await gateway.nc.publish(subjects.worker_work("w1"), b"x")
    await gateway.violations.wait("Publish", subjects.worker_work("w1"))
    await worker.nc.publish(subjects.SCHED_SUBMIT, b"x")
    await worker.violations.wait("Publish", subjects.SCHED_SUBMIT)
    await scheduler.nc.subscribe(subjects.EMBEDDINGS)
    await scheduler.violations.wait("Subscription", subjects.EMBEDDINGS)


async def test_a_cancel_reaches_the_scheduler_and_the_workers_from_the_gateway_only(bus):
    """The scheduler drops a request it holds for a cold start when its client goes away:
    under the production permissions it must hear the gateway's cancel, as workers do."""
    gateway = await bus.connect("gateway")
    scheduler = await bus.connect("scheduler")
    worker = await bus.connect("worker")
    heard = [await r.nc.subscribe(subjects.CANCEL) for r in (scheduler, worker)]
    await scheduler.nc.flush()
    await worker.nc.flush()
    cancel = messages.encode(messages.Cancel("r1", "client gone"))
    await gateway.nc.publish(subjects.CANCEL, cancel)
    for sub in heard:
        assert (await next_msg(sub)).data == cancel
    for r in (gateway, scheduler, worker):
        await r.assert_clean()
    # Only the gateway speaks for a client that went away.
    for r in (scheduler, worker):
        await r.nc.publish(subjects.CANCEL, cancel)
        await r.violations.wait("Publish", subjects.CANCEL)


@pytest.mark.parametrize("role", ["worker", "scheduler", "telemetry", "deploy", "gateway"])
async def test_no_service_role_speaks_for_the_public_api(bus, role):
    r = await bus.connect(role)
    for subject in subjects.PUBLIC_INFERENCE + (subjects.MODELS, subjects.files("put"),
                                                subjects.batches("create")):
        await r.nc.publish(subject, b"{}")
        await r.violations.wait("Publish", subject)
    if role != "gateway":  # nor takes public requests in the gateway's place
        await r.nc.subscribe(subjects.EMBEDDINGS, queue=subjects.QUEUE_GATEWAY)
        await r.violations.wait("Subscription", subjects.EMBEDDINGS)


# --- registry ------------------------------------------------------------------


async def _seed_registry(deploy):
    js = deploy.nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket=subjects.REGISTRY_META, history=5, direct=True))
    meta = {"version": "1", "sha256": {"model.safetensors": "00"}}
    await kv.put("model.all-MiniLM-L6-v2.1", json.dumps(meta).encode())
    await kv.put(ALIAS_KEY, b"1")
    obj = await js.create_object_store(subjects.REGISTRY_OBJECTS)
    weights = bytes(range(256)) * 1024  # 256 KiB: two object-store chunks
    await obj.put("all-MiniLM-L6-v2/1/model.safetensors", weights)
    return kv, weights


async def test_worker_reads_the_registry_and_follows_alias_moves(bus):
    deploy = await bus.connect("deploy")
    worker = await bus.connect("worker")
    deploy_kv, weights = await _seed_registry(deploy)

    js = worker.nc.jetstream()
    kv = await js.key_value(subjects.REGISTRY_META)
    assert json.loads((await kv.get("model.all-MiniLM-L6-v2.1")).value)["version"] == "1"
    # The non-direct read path too (a bucket created without allow_direct).
    msg = await js.get_msg(KV_STREAM, subject=f"$KV.{subjects.REGISTRY_META}.{ALIAS_KEY}")
    assert msg.data == b"1"
    obj = await js.object_store(subjects.REGISTRY_OBJECTS)
    assert (await obj.get("all-MiniLM-L6-v2/1/model.safetensors")).data == weights

    watcher = await kv.watch(ALIAS_KEY)
    assert (await watcher.updates(timeout=10)).value == b"1"
    assert await watcher.updates(timeout=10) is None  # end of the initial values
    await deploy_kv.put(ALIAS_KEY, b"2")  # only deploy moves an alias
    assert (await watcher.updates(timeout=10)).value == b"2"
    await watcher.stop()
    await worker.assert_clean()


async def test_worker_cannot_write_or_reshape_the_registry(bus):
    deploy = await bus.connect("deploy")
    worker = await bus.connect("worker")
    deploy_kv, _ = await _seed_registry(deploy)
    await deploy_kv.put(ALIAS_KEY, b"1")

    # A KV put is a publish on $KV.<bucket>.<key>: denied before it reaches the stream.
    kv = await worker.nc.jetstream().key_value(subjects.REGISTRY_META)
    put = asyncio.create_task(kv.put(ALIAS_KEY, b"evil"))
    await worker.violations.wait("Publish", f"$KV.{subjects.REGISTRY_META}.{ALIAS_KEY}")
    put.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await put
    await worker.nc.publish(f"$O.{subjects.REGISTRY_OBJECTS}.M.x", b"{}")
    await worker.violations.wait("Publish", f"$O.{subjects.REGISTRY_OBJECTS}.M.x")

    # Stream and consumer management that would change what workers load.
    for api in (f"STREAM.UPDATE.{KV_STREAM}", f"STREAM.DELETE.{KV_STREAM}",
                f"STREAM.PURGE.{OBJ_STREAM}", f"STREAM.MSG.DELETE.{KV_STREAM}",
                "STREAM.CREATE.SHADOW", f"CONSUMER.DELETE.{KV_STREAM}.c"):
        await worker.nc.publish(f"$JS.API.{api}", b"{}", reply=worker.nc.new_inbox())
        await worker.violations.wait("Publish", f"$JS.API.{api}")

    assert (await deploy_kv.get(ALIAS_KEY)).value == b"1"
    info = await deploy.nc.jetstream().stream_info(KV_STREAM)
    assert info.state.messages >= 2


@pytest.mark.parametrize("role", ["gateway", "scheduler", "telemetry", "client"])
async def test_only_deploy_moves_an_alias(bus, role):
    r = await bus.connect(role)
    subject = f"$KV.{subjects.REGISTRY_META}.{ALIAS_KEY}"
    await r.nc.publish(subject, b"canary")
    await r.violations.wait("Publish", subject)


# --- telemetry -----------------------------------------------------------------


async def test_telemetry_owns_its_stream_and_nothing_else(bus):
    telemetry = await bus.connect("telemetry")
    worker = await bus.connect("worker")
    js = telemetry.nc.jetstream()
    await js.add_stream(name=subjects.TELEMETRY_STREAM, subjects=[subjects.TELEMETRY_ALL])
    records = await telemetry.nc.subscribe(subjects.TELEMETRY_ALL)
    await telemetry.nc.flush()
    # Heartbeats also tell the gateway and the schedulers which models are served.
    listeners = []
    for role in ("gateway", "scheduler"):
        r = await bus.connect(role)
        listeners.append((r, await r.nc.subscribe(subjects.TELEMETRY_WORKERS)))
        await r.nc.flush()

    hb = Heartbeat("w1", "all-MiniLM-L6-v2", "encoder", "ready", ["1"], 0, 0, 64, 0.0, 0, 0, "cpu", 0.0)
    await worker.nc.publish(subjects.TELEMETRY_WORKERS, encode_record(hb))
    assert record_decoder.decode((await next_msg(records)).data) == hb
    for r, sub in listeners:
        assert record_decoder.decode((await next_msg(sub)).data) == hb
        await r.assert_clean()
    await telemetry.nc.publish(subjects.TELEMETRY_SUMMARY, b"summary")
    await telemetry.assert_clean()
    await worker.assert_clean()

    for subject in (subjects.EMBEDDINGS, subjects.SCHED_SUBMIT, subjects.CANCEL,
                    subjects.worker_work("w1")):
        await telemetry.nc.publish(subject, b"x")
        await telemetry.violations.wait("Publish", subject)


# --- service discovery ---------------------------------------------------------

SERVICE_OF_ROLE = {"gateway": "tensorbus-gateway", "scheduler": "tensorbus-scheduler",
                   "worker": "tensorbus-worker", "telemetry": "tensorbus-telemetry"}


@pytest.mark.parametrize("role", sorted(SERVICE_OF_ROLE))
async def test_services_answer_discovery_and_probes_from_the_operator(bus, role):
    name = SERVICE_OF_ROLE[role]
    svc_conn = await bus.connect(role)
    deploy = await bus.connect("deploy")
    svc = await add_service(svc_conn.nc, name, "0.1.0", "test", health=ServiceHealth(ready=True))
    try:
        ping = await deploy.nc.request(f"$SRV.PING.{name}", b"", timeout=10)
        assert msgspec.json.decode(ping.data)["name"] == name
        ready = await deploy.nc.request(ready_subject(name), b"", timeout=10)
        assert msgspec.json.decode(ready.data)["ready"] is True
        if role != "telemetry":  # an exec probe asks with the pod's own credential
            own = await svc_conn.nc.request(ready_subject(name), b"", timeout=10)
            assert msgspec.json.decode(own.data)["status"] == "ok"
        await svc_conn.assert_clean()
        await deploy.assert_clean()
    finally:
        await svc.stop()


async def test_a_service_cannot_take_another_services_probes(bus):
    worker = await bus.connect("worker")
    await worker.nc.subscribe(ready_subject("tensorbus-scheduler"))
    await worker.violations.wait("Subscription", ready_subject("tensorbus-scheduler"))
