"""A step blocked on a program being compiled says so (engine/programs.py):
the worker's heartbeat carries it, so the stall checks let a slow step be, and the
worker leaves that step's time out of the model's cost. A compile on the background
thread that no step waits on is not such a wait.

Real XLA compiles of a one-line program; `lower` is held on an event, so the test
looks while the compile is under way, not at a moment that happens to fall in it."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.programs import Programs


def held(entered: threading.Event, release: threading.Event):
    """A `lower` that blocks until `release`, then lowers x -> 2x + 1."""

    def lower():
        entered.set()
        assert release.wait(60)
        return jax.jit(lambda x: 2 * x + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32))

    return lower


def test_a_caller_blocked_on_a_compile_is_counted_until_it_has_its_program():
    programs = Programs("t")
    entered, release = threading.Event(), threading.Event()
    got = []
    step = threading.Thread(target=lambda: got.append(programs.get("k", held(entered, release))))
    step.start()
    assert entered.wait(60)
    assert programs.waited_on  # the step waits on this compile
    release.set()
    step.join(60)
    assert not programs.waited_on and programs.waited_s > 0
    np.testing.assert_allclose(np.asarray(got[0](jnp.arange(4.0))), [1, 3, 5, 7])
    # Compiled now: asking again is no wait, and adds no waited time.
    before = programs.waited_s
    programs.get("k", held(threading.Event(), threading.Event()))
    assert programs.waited_s == before and not programs.waited_on


def test_the_background_compiling_is_no_wait_until_a_step_asks_for_its_program():
    programs = Programs("t")
    entered, release = threading.Event(), threading.Event()
    programs.start_background([("k", held(entered, release))])
    assert entered.wait(60)
    assert not programs.waited_on  # nobody waits on it: the steps run on
    # A step asks for the program being compiled there: it waits on that compile.
    step = threading.Thread(target=programs.get, args=("k", None))
    step.start()
    waiting = threading.Event()
    for _ in range(6000):  # until the step has joined the wait (a counted state)
        if programs.waited_on:
            waiting.set()
            break
        step.join(0.01)
    assert waiting.is_set()
    release.set()
    step.join(60)
    assert programs.wait_background(60)
    assert not programs.waited_on and programs.compiled == 1


def test_near_the_memory_map_limit_compiles_stop_with_a_clear_error_not_a_crash(monkeypatch):
    """XLA's CPU JIT maps each kernel apart; an mmap refused at vm.max_map_count
    aborts the process from inside LLVM. Near the limit the background stops and an
    asked-for program fails with the fix in its message; compiled ones still run."""
    from engine import jaxrt

    def lower(x):
        return lambda: jax.jit(lambda v: v * x).lower(jax.ShapeDtypeStruct((4,), jnp.float32))

    programs = Programs("t")
    first = programs.get("a", lower(2.0))
    held, limit = jaxrt.map_count()
    assert limit > held > 0  # read from /proc on Linux
    monkeypatch.setattr(jaxrt, "map_count", lambda: (limit - jaxrt.MAP_RESERVE + 1, limit))
    programs.start_background([("b", lower(3.0)), ("c", lower(4.0))])
    programs.wait_background(60)
    assert not programs.compiling and programs.total == 1  # the rest was left
    with pytest.raises(jaxrt.MapLimit, match="vm.max_map_count"):
        programs.get("d", lower(5.0))
    np.testing.assert_allclose(np.asarray(first(jnp.arange(4.0))), [0, 2, 4, 6])


def test_a_wanted_program_is_compiled_next_beside_the_background_not_behind_it():
    """A step run in parts of a smaller program wants the one that holds it: that one
    leaves the background's queue and compiles at once on a thread of its own (the
    background runs at idle priority, which a busy server never leaves it), while
    the background is still held on its first job."""
    programs = Programs("t")
    entered, release = threading.Event(), threading.Event()
    heard = []
    programs.listeners.append(lambda: heard.append(programs.compiled))

    def lower(x):
        return lambda: jax.jit(lambda v: v * x).lower(jax.ShapeDtypeStruct((4,), jnp.float32))

    c_entered, c_release = threading.Event(), threading.Event()
    programs.start_background([("a", held(entered, release)), ("b", lower(3.0)),
                               ("c", held(c_entered, c_release))])  # fmt: skip
    assert entered.wait(60)  # the background is inside "a", and stays there
    assert not programs.want("a")  # being compiled: nothing to move
    assert programs.want("c")
    assert c_entered.wait(60)  # compiling, on its own thread
    assert not programs.want("b")  # one wanted compile at a time
    assert programs.total == 3 and programs.compiling
    c_release.set()
    programs._wanted.join(60)
    assert programs.has("c") and not programs.has("b") and not programs.has("a")
    assert heard == [1]  # the engine hears of it as of a background compile
    assert not programs.want("c")  # compiled: nothing to want
    release.set()
    assert programs.wait_background(60)
    assert programs.compiled == programs.total == 3 and not programs.compiling
    np.testing.assert_allclose(np.asarray(programs.get("c", None)(jnp.arange(4.0))), [1, 3, 5, 7])
