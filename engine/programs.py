"""An engine's compiled programs, by shape: what the first request needs first.

An engine serves many shapes (a decoder's decode steps per batch bucket and attention
window and prefill chunks per length bucket and context; an encoder's batches per
(batch, sequence) bucket), too many to compile before the model may answer: SmolLM2
at 64 slots and an 8k context has ~70, MiniLM 35. So:

  1. `warmup` compiles a small first set (a decoder: batch bucket 1 and the
     smallest window, the prefill buckets at the smallest context; an encoder: one
     input at every length): the model is ready then.
  2. `start_background(jobs)` compiles the rest on a thread of its own, smallest
     first; a program joins the moment it is compiled (`has` says so; `listeners`
     hear it), and the engine picks among the compiled ones (a larger bucket serves
     a smaller load). More jobs may be queued later, behind or ahead of those
     waiting (a bucket's measured compute form), and `drop` forgets programs and
     jobs nothing will run.
  3. A shape nobody compiled yet and no compiled one can stand in for is compiled
     where it is asked for (`get`), once: a caller that asks for a shape the
     background thread is compiling waits for that compile, not a second one.

The background thread runs at the lowest CPU priority (`idle_priority`): on cores it
shares with serving, the serving thread runs first. Compiling goes through JAX's
persistent cache (engine/jaxrt.py), so a restarted
worker reads its programs instead of compiling them. Compiled executables are
called directly (donation is kept); XLA's compile runs outside the GIL, so the
background thread costs the serving thread cores, not the interpreter.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from engine import jaxrt
from shared.logging import get_logger

log = get_logger(__name__)

K = TypeVar("K", bound=Hashable)  # a program's key: its shape (and form)


class Programs(Generic[K]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._done: dict[K, object] = {}
        self._busy: dict[K, threading.Event] = {}  # being compiled -> set when done
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: deque[tuple[K, Callable[[], object]]] = deque()  # background's
        self.listeners: list[Callable[[], None]] = []  # called (on its thread) as one joins
        self.compile_seconds = 0.0
        self._urgent: K | None = None  # being compiled for `want`
        self._wanted: threading.Thread | None = None  # ... on this thread
        self._waiting = 0  # callers (not the background thread) blocked on a compile
        self.waited_s = 0.0  # the time they spent blocked, since start

    def has(self, key: K) -> bool:
        return key in self._done

    @property
    def compiled(self) -> int:
        return len(self._done)

    def keys(self) -> list[K]:
        return list(self._done)

    @property
    def waited_on(self) -> bool:
        """Whether a caller other than the background thread (the engine thread, a
        step) is blocked on a compile now: its step is slow, not stuck."""
        return self._waiting > 0

    def compile_together(self, jobs: list[tuple[K, Callable[[], object]]],
                         done: Callable[[K], None] = lambda key: None) -> None:
        """Compile `jobs` now, one per core at a time (at most 4), calling `done(key)`
        as each is ready: the first set before ready. Tracing holds the interpreter
        but XLA's compile does not: SmolLM2's first three programs took 9.4 s
        against 11.4 s one by one on two cores."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        workers = max(1, min(4, os.cpu_count() or 1, len(jobs)))
        with ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
            futures = {pool.submit(self.get, key, lower): key for key, lower in jobs}
            for f in as_completed(futures):
                f.result()  # a failed compile fails the warm-up, as it would one by one
                done(futures[f])

    def get(self, key: K, lower: Callable[[], object]):
        """The executable for `key`, compiled now (from `lower()`) if nobody has."""
        exe = self._done.get(key)
        if exe is not None:
            return exe
        waiter = threading.current_thread() not in (self._thread, self._wanted)
        with self._lock:
            self._waiting += waiter
        t0 = time.perf_counter()
        try:
            return self._get(key, lower)
        finally:
            with self._lock:
                self._waiting -= waiter
                self.waited_s += (time.perf_counter() - t0) * waiter

    def _get(self, key: K, lower: Callable[[], object]):
        with self._lock:
            exe = self._done.get(key)
            if exe is not None:
                return exe
            event = self._busy.get(key)
            mine = event is None
            if event is None:
                event = self._busy[key] = threading.Event()
        if not mine:
            event.wait()
            exe = self._done.get(key)
            if exe is not None:
                return exe
            return self._get(key, lower)  # its compile failed there: try here
        try:
            t0 = time.perf_counter()
            exe = jaxrt.compile_lowered(lower())
            seconds = time.perf_counter() - t0
            self.compile_seconds += seconds
            # Which program a request waited on, when it was not compiled ahead.
            log.debug("program_compiled", model=self.name, program=str(key),
                      seconds=round(seconds, 3))
            self._done[key] = exe
            return exe
        finally:
            with self._lock:
                self._busy.pop(key, None)
            event.set()

    def start_background(self, jobs: list[tuple[K, Callable[[], object]]],
                         first: bool = False) -> None:
        """Compile `jobs` (in order) on a daemon thread; each joins when done. Called
        again (more jobs: a bucket's measured form, engine/decoder/formchoice.py), it
        queues them behind those still waiting, or (`first`) ahead of them."""
        with self._lock:
            new = [(k, f) for k, f in jobs if k not in self._done]
            queued = {k for k, _ in self._queue}
            busy = self._queue.popleft() if self._queue and self.compiling else None  # head
            if first:
                keys = {k for k, _ in new}
                items = [(k, f) for k, f in new if busy is None or k != busy[0]] + [
                    (k, f) for k, f in self._queue if k not in keys]
            else:
                items = list(self._queue) + [(k, f) for k, f in new if k not in queued]
            self._queue.clear()
            self._queue.extend(([busy] if busy is not None else []) + items)
            if not self._queue or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._work, name=f"compile-{self.name}",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def want(self, key: K) -> bool:
        """A program the serving path stands in for right now (a step run in parts of
        a smaller one): compiled next, at normal priority on a thread of its own,
        rather than at idle priority behind the rest. At 16 streams on two cores the
        serving thread leaves the idle one nothing, and a cold start ran its steps as
        16 one-row parts for a minute. One such compile at a time; False when the key
        is not waiting (compiled, being compiled, or never queued)."""
        with self._lock:
            if self._urgent is not None or key in self._done or key in self._busy:
                return False
            found = [(k, f) for k, f in self._queue if k == key]
            if not found or (self.compiling and self._queue[0][0] == key):
                return False
            self._queue.remove(found[0])
            self._urgent = key
        self._wanted = threading.Thread(target=self._compile_wanted, args=found[0], daemon=True,
                                        name=f"compile-{self.name}-wanted")  # fmt: skip
        self._wanted.start()
        return True

    def _compile_wanted(self, key: K, lower: Callable[[], object]) -> None:
        try:
            self.get(key, lower)
        except Exception as exc:  # noqa: BLE001 - compiled (and failing) where needed instead
            log.warning("wanted_compile_failed", model=self.name, program=str(key),
                        error=repr(exc))  # fmt: skip
        finally:
            with self._lock:
                self._urgent = None
        log.info("wanted_program_compiled", model=self.name, program=str(key))
        self._tell()

    def _tell(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception as exc:  # noqa: BLE001 - a listener gone (its loop closed)
                log.debug("compile_listener_failed", model=self.name, error=repr(exc))

    def _work(self) -> None:
        idle_priority()
        t0 = time.perf_counter()
        while True:
            if self._stop.is_set():
                return
            with self._lock:
                if not self._queue:
                    self._thread = None  # a later `start_background` starts another
                    break
                key, lower = self._queue[0]
            try:
                self.get(key, lower)
            except LookupError:
                return  # its engine was dropped
            except jaxrt.MapLimit as exc:
                # Compiling on would take the process down: what is compiled serves
                # (in parts, engine/decoder/compiled.py); the rest is left.
                with self._lock:
                    left = len(self._queue)
                    self._queue.clear()
                    self._thread = None
                log.warning("background_compiles_stopped", model=self.name, left=left,
                            compiled=self.compiled, reason=str(exc))  # fmt: skip
                return
            except Exception as exc:  # noqa: BLE001 - a shape that will not compile
                # is compiled (and fails) where it is needed instead; log it here.
                log.warning("background_compile_failed", model=self.name,
                            program=str(key), error=repr(exc))  # fmt: skip
            with self._lock:
                self._queue.popleft()
            self._tell()
        log.info("programs_compiled_all", model=self.name, programs=self.compiled,
                 seconds=round(time.perf_counter() - t0, 3))  # fmt: skip

    @property
    def total(self) -> int:
        """Programs this engine will have once the background is done."""
        urgent = self._urgent
        return (len(self._done) + sum(1 for k, _ in list(self._queue) if k not in self._done)
                + (urgent is not None and urgent not in self._done))

    def drop(self, keep: Callable[[K], bool]) -> None:
        """Forget compiled programs and skip waiting ones that `keep` refuses (a form
        no bucket runs any more: its executables' memory goes back)."""
        with self._lock:
            for key in [k for k in self._done if not keep(k)]:
                del self._done[key]
            waiting = [(k, f) for k, f in self._queue if keep(k)]
            head = self._queue[0] if self._queue else None
            self._queue.clear()
            if head is not None and not keep(head[0]):
                self._queue.append(head)  # being compiled now: popped when done
            self._queue.extend(waiting)

    @property
    def compiling(self) -> bool:
        """Whether the background thread (or a `want`ed compile) is still compiling."""
        thread = self._thread
        return self._urgent is not None or (thread is not None and thread.is_alive())

    def wait_background(self, timeout: float | None = None) -> bool:
        """Block until the background compiles (and a `want`ed one) are done."""
        t0 = time.perf_counter()
        for thread in (self._wanted, self._thread):
            if thread is not None:
                left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - t0))
                thread.join(left)
        return not self.compiling

    def stop(self) -> None:
        """Compile nothing more in the background (the engine is being dropped)."""
        self._stop.set()


def idle_priority() -> None:
    """The calling thread (and the threads it starts) at the lowest CPU priority
    (Linux: nice 19 on its thread id): a background compile takes the cores the
    serving thread leaves, never the other way round. Elsewhere, or not permitted,
    nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
