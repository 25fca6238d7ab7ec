"""The worker's Outbox: answers grouped into one message per gateway, on a real
nats-server (and `grouped`, the grouping itself, on its own)."""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.worker.runner import Outbox, grouped
from shared import subjects
from shared.errors import ServiceError
from shared.messages import (EmbedResult, EmbedWork, GenChunk, GenDone, GenerateWork, Results,
                             Sampling, Timing, WorkError, done_decoder, result_decoder,
                             results_decoder)


def gen(rid: str, gateway: str, sched: str = "s1") -> GenerateWork:
    return GenerateWork(rid, "m", "", [1, 2], 4, Sampling(), [], 1, True, time.time() + 30,
                        f"{gateway}.{rid}" if gateway else f"plain.{rid}", sched,
                        group=subjects.reply_group(gateway) if gateway else "")


def chunk(rid: str, text: str) -> GenChunk:
    return GenChunk(rid, 0, text, 1, None, 0, "1")


def test_one_message_per_gateway_in_order_and_plain_replies_alone():
    a1, a2, b1, p1 = gen("a1", "GW_A"), gen("a2", "GW_A"), gen("b1", "GW_B"), gen("p1", "")
    staged = [(w.group, w.reply, m) for w, m in [
        (a1, chunk("a1", "x")), (p1, chunk("p1", "p")), (b1, chunk("b1", "y")),
        (a2, chunk("a2", "z")), (a1, chunk("a1", "w")), (p1, chunk("p1", "q"))]]
    out = grouped(staged, 1 << 20)
    assert [s for s, _ in out] == ["GW_A.results", "plain.p1", "GW_B.results", "plain.p1"]
    a = results_decoder.decode(out[0][1]).items
    assert [(i.request_id, i.text) for i in a] == [("a1", "x"), ("a2", "z"), ("a1", "w")]
    assert [i.text for i in results_decoder.decode(out[2][1]).items] == ["y"]
    assert [result_decoder.decode(p).text for s, p in out if s == "plain.p1"] == ["p", "q"]


def test_a_group_over_the_payload_limit_is_split_in_order():
    works = [EmbedWork(f"r{i}", "m", "", [[1]], time.time() + 30, f"GW.r{i}",
                       group=subjects.reply_group("GW")) for i in range(7)]
    staged = [(w.group, w.reply, EmbedResult(w.request_id, "w", "m", "1", 250,
                                             bytes(1000), 1, Timing())) for w in works]
    out = grouped(staged, 2500)
    assert len(out) > 1 and all(len(p) <= 2500 for _, p in out)
    ids = [i.request_id for _, p in out for i in results_decoder.decode(p).items]
    assert ids == [w.request_id for w in works]


async def test_a_step_goes_out_as_one_message_then_the_scheduler_hears(nc):
    gw = nc.new_inbox()
    seen: list[tuple[str, bytes]] = []
    got = asyncio.Event()

    async def on_msg(msg):
        seen.append((msg.subject, msg.data))
        got.set()

    sub = await nc.subscribe(">", cb=on_msg)  # one subscription: arrival order is kept
    await nc.flush()
    outbox = Outbox(nc, "w1", "m")
    a, b, plain = gen("a", gw), gen("b", gw), gen("p", "")
    async with outbox.held():
        await outbox.publish(a, chunk("a", "1"))
        await asyncio.to_thread(int)  # a step waits on the engine thread: still held
        await outbox.publish(b, chunk("b", "2"))
        await outbox.error(plain, ServiceError(500, "boom"))
        await outbox.publish(a, GenDone("a", "w1", "m", "1", 2, 1, Timing()))
        await outbox.done({"s1": ["a"]})
    await nc.flush()
    await asyncio.wait_for(_until(lambda: len(seen) >= 3, got), 5)
    mine = [(s, d) for s, d in seen if s.startswith(gw) or s in ("plain.p", "tensorbus.v1.sched.s1.done")]
    assert [s for s, _ in mine] == [f"{gw}.results", "plain.p", "tensorbus.v1.sched.s1.done"]
    items = results_decoder.decode(mine[0][1]).items
    assert [type(i) for i in items] == [GenChunk, GenChunk, GenDone]
    assert isinstance(result_decoder.decode(mine[1][1]), WorkError)
    assert done_decoder.decode(mine[2][1]).request_ids == ["a"]

    # Outside a step, what is staged goes out when the loop next runs: nobody waits
    # for a flush that would only come with a later step.
    seen.clear()
    got.clear()
    await outbox.publish(a, chunk("a", "3"))
    await asyncio.wait_for(_until(lambda: any(s == f"{gw}.results" for s, _ in seen), got), 5)
    await sub.unsubscribe()


async def _until(cond, event: asyncio.Event) -> None:
    while not cond():
        event.clear()
        await event.wait()


def test_results_carry_every_answer_kind():
    items = [chunk("a", "x"), GenDone("a", "w", "m", "1", 1, 1, Timing()),
             WorkError("b", 500, "no"), EmbedResult("c", "w", "m", "1", 1, b"\0" * 4, 1, Timing())]
    back = results_decoder.decode(msgspec.msgpack.encode(Results(items))).items
    assert back == items
