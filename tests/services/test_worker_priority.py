"""The engine's threads go below the event loop's priority; the caller's thread stays.

Run in a child process: a nice value raised cannot be taken back, and the test
process's own threads (an engine's pool from another test) must keep theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, os, threading
from services.worker.priority import lower_threads

started, release, tids = threading.Event(), threading.Event(), []

def engine_thread():
    tids.append(threading.get_native_id())
    started.set()
    release.wait()

t = threading.Thread(target=engine_thread)
t.start()
started.wait(10)
own = threading.get_native_id()
out = {"base": os.getpriority(os.PRIO_PROCESS, own), "zero": lower_threads(0)}
out["zero_engine"] = os.getpriority(os.PRIO_PROCESS, tids[0])
out["lowered"] = lower_threads(3)
out["engine"] = os.getpriority(os.PRIO_PROCESS, tids[0])
out["own"] = os.getpriority(os.PRIO_PROCESS, own)
out["again"] = lower_threads(3)
out["engine_again"] = os.getpriority(os.PRIO_PROCESS, tids[0])
release.set()
t.join()
print(json.dumps(out))
"""


def test_other_threads_are_lowered_once_and_the_callers_is_not():
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    base = out["base"]
    assert out["zero"] == 0 and out["zero_engine"] == base  # 0: nothing changes
    assert out["lowered"] >= 1
    assert out["engine"] == min(19, base + 3)
    assert out["own"] == base  # the event loop's thread keeps its priority
    assert out["again"] == 0 and out["engine_again"] == min(19, base + 3)  # idempotent
