"""Exec probes (`python -m services.worker --check ready`) find their own instance."""

from __future__ import annotations

import os
import subprocess
import sys

from services.probe import probe
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack


async def test_probe_answers_for_this_instance_only(nats_server):
    async with running_stack(nats_server.url) as st:
        await st.add_worker(MockEncoder(), "w-probe")
        assert await probe(nats_server.url, "tensorbus-worker", "ready", "w-probe", timeout=2)
        assert await probe(nats_server.url, "tensorbus-worker", "health", "w-probe", timeout=2)
        assert not await probe(nats_server.url, "tensorbus-worker", "ready", "someone-else", timeout=0.5)
        assert await probe(nats_server.url, "tensorbus-scheduler", "ready", st.scheduler.id, timeout=2)


def test_check_flag_exits_nonzero_without_the_service(nats_server):
    env = dict(os.environ, TENSORBUS_NATS_URL=nats_server.url, TENSORBUS_WORKER_ID="absent")
    r = subprocess.run([sys.executable, "-m", "services.worker", "--check", "ready"], env=env,
                       capture_output=True, timeout=30)
    assert r.returncode == 1
