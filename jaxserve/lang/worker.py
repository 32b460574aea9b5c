"""SerialWorker: runs a state's operations one at a time, in submission order, off the program's thread.

`s += gen(...)` must not block the program: forked branches are filled in a loop
(`for f in forks: f += gen(...)`) and must generate in parallel. Each state therefore queues its
operations on its own worker (SGLang's StreamExecutor does the same). The thread exists only while
there is work, so idle states hold no threads. After an operation raises, the rest are skipped and
`wait()` returns the error.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable


class SerialWorker:
    def __init__(self, name: str = "jaxserve-lang-state"):
        self._name = name
        self._lock = threading.Lock()
        self._ops: collections.deque[Callable[[], None]] = collections.deque()
        self._is_running = False
        self._idle = threading.Event()
        self._idle.set()
        self.error: BaseException | None = None

    def submit(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)
            self._idle.clear()
            if not self._is_running:
                self._is_running = True
                threading.Thread(target=self._drain, name=self._name, daemon=True).start()

    def wait(self) -> BaseException | None:
        """Block until every submitted operation has run (or been skipped); return the error, if any."""
        self._idle.wait()
        return self.error

    @property
    def is_idle(self) -> bool:
        return self._idle.is_set()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._ops:
                    self._is_running = False
                    self._idle.set()
                    return
                op = self._ops.popleft()
            if self.error is None:
                try:
                    op()
                except BaseException as e:  # noqa: BLE001 - handed to whoever reads the state
                    self.error = e
