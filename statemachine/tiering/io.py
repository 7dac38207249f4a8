"""Where secondary tiers run their I/O, and the CPU tier's bytes they copy.

`PrimaryBuffer` is the CPU (primary) tier's memory as a secondary tier sees it: one row of
``slot_bytes`` bytes per CPU slot (vLLM hands each tier a memoryview over the shared CPU
buffer and addresses slot *c* as ``view[c]``, TB:177-200, TM:160-167). `BytearrayBuffer` is
the test implementation.

An executor runs a tier's I/O tasks; one task is one job's batch of copies, as vLLM's
filesystem tier enqueues one task per job (TF:222-236, TF:238-276). Two executors, one
contract:

* `InlineExecutor` (the default) runs nothing on its own: the queued tasks run, in order, on
  the caller's thread, when `run` is called. This is vLLM's thread pool (TP:60-194) with
  the scheduling made explicit: "a pool thread finished the task" is "`run` ran it", so a
  test decides exactly when I/O happens and every run is reproducible.
* `ThreadedExecutor(threads)` runs the same tasks on real threads as soon as they are
  submitted (TP:162-194); `run` waits until every task that can run has run, and
  `wait_idle` waits, up to a deadline, until none is queued or running (TP:138-147).

Both can be *hung* (beyond vLLM, for tests): tasks not yet started stay queued until
`unhang`; a started task always finishes (a copy is never cut in half, TB:383-386).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from statemachine.errors import ConfigError

Task = Callable[[], None]
"""One job's I/O. It must not raise: a tier's task reports its own failure."""


class PrimaryBuffer(Protocol):
    """The CPU tier's slots, as bytes."""

    @property
    def slot_bytes(self) -> int: ...

    def read(self, slot: int) -> bytes:
        """The bytes of one slot (a cascade copies them out)."""
        ...

    def write(self, slot: int, data: bytes) -> None:
        """Overwrite one slot (a promotion copies into it); ``len(data) == slot_bytes``."""
        ...


class BytearrayBuffer:
    """A `PrimaryBuffer` over one bytearray of ``num_slots * slot_bytes`` bytes."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        for name, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._data = bytearray(num_slots * slot_bytes)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def _span(self, slot: int) -> slice:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside [0, {self.num_slots})")
        return slice(slot * self._slot_bytes, (slot + 1) * self._slot_bytes)

    def read(self, slot: int) -> bytes:
        return bytes(self._data[self._span(slot)])

    def write(self, slot: int, data: bytes) -> None:
        if len(data) != self._slot_bytes:
            raise ValueError(f"slot {slot}: {len(data)} bytes, a slot holds "
                             f"{self._slot_bytes}")
        self._data[self._span(slot)] = data


class Executor(Protocol):
    def submit(self, task: Task) -> None: ...

    def run(self) -> int:
        """Let every task that can run (the executor is not hung) finish; returns how
        many ran in this call (the inline executor) or 0 (threads ran them)."""
        ...

    def wait_idle(self, timeout_s: float) -> bool:
        """Run (inline) or wait (threads, at most `timeout_s`) until no task is queued or
        running; False when some still is (the executor is hung)."""
        ...

    def pending(self) -> int:
        """Tasks queued or running."""
        ...

    def hang(self) -> None: ...

    def unhang(self) -> None: ...

    def shutdown(self) -> None:
        """Drop queued tasks (their jobs never report) and stop the threads."""
        ...


class InlineExecutor:
    """Deterministic: queued tasks run only inside `run`, in submission order."""

    def __init__(self) -> None:
        self._queue: deque[Task] = deque()
        self._hung = False

    def submit(self, task: Task) -> None:
        self._queue.append(task)

    def run(self) -> int:
        ran = 0
        while self._queue and not self._hung:
            self._queue.popleft()()
            ran += 1
        return ran

    def wait_idle(self, timeout_s: float) -> bool:
        del timeout_s  # a hung inline executor never finishes: the deadline is now
        self.run()
        return not self._queue

    def pending(self) -> int:
        return len(self._queue)

    def hang(self) -> None:
        self._hung = True

    def unhang(self) -> None:
        self._hung = False

    def shutdown(self) -> None:
        self._queue.clear()


class ThreadedExecutor:
    """A pool of `threads` threads that start each task as soon as one is free."""

    def __init__(self, threads: int, name: str = "tier_io") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
        self._cv = threading.Condition()
        self._queue: deque[Task] = deque()
        self._running = 0
        self._hung = False
        self._stop = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, task: Task) -> None:
        with self._cv:
            self._queue.append(task)
            self._cv.notify()

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or (bool(self._queue) and not self._hung))
                if self._stop:
                    return
                task = self._queue.popleft()
                self._running += 1
            try:
                task()
            finally:
                with self._cv:
                    self._running -= 1
                    self._cv.notify_all()

    def run(self) -> int:
        with self._cv:
            self._cv.wait_for(lambda: self._running == 0 and (not self._queue or self._hung))
        return 0

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._running == 0 and not self._queue,
                                     timeout_s)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._running

    def hang(self) -> None:
        with self._cv:
            self._hung = True

    def unhang(self) -> None:
        with self._cv:
            self._hung = False
            self._cv.notify_all()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()


def make_executor(threads: int, name: str) -> Executor:
    """`InlineExecutor` for ``threads == 0``, else a `ThreadedExecutor`."""
    return InlineExecutor() if threads == 0 else ThreadedExecutor(threads, name)


__all__ = ["BytearrayBuffer", "Executor", "InlineExecutor", "PrimaryBuffer", "Task",
           "ThreadedExecutor", "make_executor"]
