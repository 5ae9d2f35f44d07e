"""Who gets a connection to ``lmkv serve``, and how fast a wrong token can be retried.

Four bounds, each a count the server holds while a connection lives:

- per peer (a TCP address, or a uid on the Unix socket), until it authenticates:
  ``server.max_per_peer``; an authenticated connection counts against its tenant instead, so
  tenants whose clients share an address (every local client is 127.0.0.1) never crowd each
  other out through it;
- connections that have not authenticated yet: ``server.max_unauthenticated``, a small cap
  of its own, so clients that connect and never say HELLO (or say it one byte at a time)
  cannot take the slots authenticated clients use; each has ``server.hello_timeout`` seconds
  in all to authenticate, however slowly its bytes trickle in;
- per tenant: ``quota.connections`` (by default an equal share of ``server.max_connections``),
  so one tenant's clients cannot take every slot and lock the others out;
- authenticated connections: ``server.max_connections``, taken only once HELLO succeeded.

A failed authentication is logged (once a minute per peer, with the count) and answered only
after a delay that doubles with the peer's recent failures, so guessing a token costs time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: the first failed authentication's delay, its ceiling, and how long a peer's failures are remembered
FAIL_DELAY_S = 0.25
FAIL_DELAY_MAX_S = 4.0
FAIL_MEMORY_S = 300.0


class Counts:
    """Connections per peer (or per tenant), each capped by ``limit(who)``."""

    def __init__(self, limit: Callable[[str], int]) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._n: dict[str, int] = {}

    def enter(self, peer: str) -> bool:
        with self._lock:
            if self._n.get(peer, 0) >= self.limit(peer):
                return False
            self._n[peer] = self._n.get(peer, 0) + 1
            return True

    def leave(self, peer: str) -> None:
        with self._lock:
            left = self._n.get(peer, 1) - 1
            if left:
                self._n[peer] = left
            else:
                self._n.pop(peer, None)


class AuthFailures:
    """Recent failed authentications per peer: the delay before each answer, and the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int, float, float]] = {}  # peer -> (count, last, last logged)

    def failed(self, peer: str, why: str) -> float:
        """Count a failure; the seconds to wait before answering it."""
        now = time.monotonic()
        with self._lock:
            count, last, logged = self._failures.get(peer, (0, now, -1e9))
            count = 1 if now - last > FAIL_MEMORY_S else count + 1
            if now - logged >= 60:
                log.warning("lmkv serve: %s failed to authenticate (%s); %d failures lately", peer, why, count)
                logged = now
            self._failures[peer] = (count, now, logged)
            if len(self._failures) > 65536:  # forget the stalest peers, not the server's memory
                for p in sorted(self._failures, key=lambda p: self._failures[p][1])[:32768]:
                    del self._failures[p]
        return min(FAIL_DELAY_MAX_S, FAIL_DELAY_S * 2 ** (count - 1))
