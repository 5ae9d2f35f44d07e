"""Health per Redis Cluster node, so one dead or hung primary costs only its own slots' pages.

A cluster is many backends behind one tier. Marking the whole tier down at the
first node that fails would turn every read of the surviving slots into a miss
until the dead node's replica is promoted; so each node (named ``host:port``)
gets its own :class:`~lmkv.tiers.remote.Health`: a key whose slot a down node
serves is a miss at once, the others are read as usual. A down node's
reconnect loop asks the cluster for its slot map first: once a replica has
taken the node's slots over, the node's keys are served again (from the
replica) and the outage ends, logged once, as its start was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from redis.cluster import RedisCluster
from redis.exceptions import SlotNotCoveredError

from lmkv import threads
from lmkv.tiers.remote import Health


class ClusterNodes:
    """Which node serves a key, and whether that node is up.

    ``client`` returns redis-py's blocking ``RedisCluster`` (the one whose slot map is asked here).
    """

    def __init__(self, tier: str, client: Callable[[], RedisCluster]) -> None:
        self._tier = tier
        self._client = client
        self._health: dict[str, Health] = {}
        self._lock = threading.Lock()

    def node_of(self, name: bytes) -> str | None:
        """The node serving ``name``'s slot by the client's current map (``None``: no node does)."""
        c = self._client()
        try:
            return c.nodes_manager.get_node_from_slot(c.keyslot(name)).name
        except SlotNotCoveredError:
            return None

    def health(self, node: str) -> Health:
        with self._lock:
            h = self._health.get(node)
            if h is None:
                h = self._health[node] = Health(f"{self._tier} node {node}", lambda: self._ping(node))
            return h

    def group(self, names: Sequence[bytes]) -> dict[str, list[int]]:
        """Indices of ``names`` by the node serving them; names on a down node or on no node are left out."""
        out: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            node = self.node_of(name)
            if node is not None and self.health(node).up:
                out.setdefault(node, []).append(i)
        return out

    def failed(self, node: str, err: BaseException) -> None:
        self.health(node).failed(err)

    @property
    def down(self) -> list[str]:
        with self._lock:
            return sorted(n for n, h in self._health.items() if not h.up)

    def refresh(self, timeout: float) -> bool:
        """Ask the cluster for its slot map again (a node answered ``MOVED``: a slot moved), waiting
        ``timeout`` seconds at most; whether the new map came in time. A cluster that cannot answer
        keeps the old map (its nodes' own failures tell); a refresh still running when the caller
        stops waiting completes on its own thread."""
        done = threading.Event()

        def run() -> None:
            try:
                self._client().nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - the next command to a stale node fails and marks it
                return
            done.set()

        threads.start(run, f"lmkv-{self._tier}-slots")
        return done.wait(max(0.0, timeout))

    def _ping(self, node: str) -> str | None:
        """Raise while ``node``'s slots are unserved; say how they are served again."""
        c = self._client()
        c.nodes_manager.initialize()  # the cluster's view now: a failover moves the node's slots
        if node not in {n.name for n in c.get_primaries()}:
            return "its slots are served by its replica now"
        info = c.cluster_info(target_nodes=c.get_node(node_name=node))
        if info.get("cluster_state") != "ok":  # it answers, but refuses keys (its cluster lost a slot)
            raise ConnectionError(f"{node}: cluster_state {info.get('cluster_state')}")
        return None

    def close(self) -> None:
        with self._lock:
            for h in self._health.values():
                h.close()
