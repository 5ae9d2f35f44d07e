"""A Mooncake Store client that is closed only once no call is using it.

Mooncake 0.3.13's ``close`` frees the client's state while a call on another thread is still
inside it, and the process dies (SIGSEGV in that call). The Mooncake tier runs every call on a
thread of its own and waits for it at most ``remote.timeout``, so a call given up on, as when the
master stalls, is still in flight when the engine shuts down and closes the tier. Measured: a
read given up on a stopped master, the master resumed, the tier closed at once: the process
crashed on every one of six tries.

So each call goes through :class:`MooncakeClient`, which counts it in and out; :meth:`close`
refuses calls from then on (they fail as ``RuntimeError``, as the binding's own failures do, and
the tier counts those as its outage) and the last call to return does the closing. Closing never
waits for a call: an engine shutting down behind a stalled master does not hang on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class MooncakeClient:
    """``store`` (a ``MooncakeDistributedStore`` set up with its master), its methods called through
    this object; thread-safe."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._calls = 0  # in flight now
        self._closing: Callable[[Any], None] | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            with self._lock:
                if self._closing is not None:
                    raise RuntimeError(f"Mooncake client closed: {name} not called")
                self._calls += 1
            try:
                return method(*args)
            finally:
                self._leave()

        return call

    def close(self, last: Callable[[Any], None]) -> None:
        """No call from now on; ``last(store)``, the client's last words (ending its get sessions,
        unregistering its buffers, closing it), runs once no call is in flight: here, or on the
        thread of the last call to return. A second close does nothing."""
        with self._lock:
            if self._closing is not None:
                return
            self._closing = last
            busy = self._calls
        if not busy:
            self._finish()
        else:
            log.info("lmkv: the Mooncake client closes once its %d calls in flight return", busy)

    def _leave(self) -> None:
        with self._lock:
            self._calls -= 1
            last = self._calls == 0 and self._closing is not None
        if last:
            self._finish()

    def _finish(self) -> None:
        assert self._closing is not None
        try:
            self._closing(self._store)
        except (RuntimeError, ValueError) as err:
            log.info("lmkv: closing the Mooncake client: %s", err)
