"""``lmkv serve``: one process holding memory and disk tiers (Redis optionally beneath) for many engines.

- Transport: lmkv's framed protocol (:mod:`lmkv.wire.protocol`) over TCP (TLS optional) and, for
  clients on this host, an abstract Unix socket, its name told only to clients that reached the
  TCP port from this host; one thread per connection (:mod:`lmkv.serve.connection`).
- Admission (:mod:`lmkv.serve.admission`): a token unless bound to loopback; a deadline for
  HELLO, a cap on connections still unauthenticated (the oldest goes), a client slot only after
  HELLO, a cap per peer, slower answers to wrong tokens.
- Tenants (:mod:`lmkv.serve.tenants`): pages are charged to their tenant, within its quota, in
  every local tier. STATS and CLEAR see the caller's tenant only; the admin token sees the server.
- Durability: pages on the disk tier survive a restart (its index is rebuilt from the files);
  clients reconnect by themselves.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import ssl
import threading
from collections import OrderedDict

from lmkv.config import ConfigError, LMKVConfig
from lmkv.errors import LMKVError
from lmkv.metrics import serve_metrics
from lmkv.serve.admission import AuthFailures, Counts
from lmkv.serve.arenas import Arenas
from lmkv.serve.connection import Client, Fatal
from lmkv.serve.tenants import Counters, Tenant, Tenants
from lmkv.store import TieredStore
from lmkv.tiers.accounts import Limit
from lmkv.wire import shm_window
from lmkv.wire.protocol import (
    ErrorReply,
    encode,
    frame,
    is_loopback,
)

log = logging.getLogger(__name__)


class Server:
    """The listeners, admission, tenants' counters and the store they share.

    :meth:`serve_forever` accepts on the calling thread (the Unix socket on one more), each
    connection on a thread of its own; :meth:`stop` (any thread, or SIGINT/SIGTERM through
    :func:`serve`) stops accepting, revokes every connection's copies into its client's memory,
    ends the connections and closes the store.
    """

    def __init__(self, cfg: LMKVConfig) -> None:
        sc = cfg.server
        self.tenants = Tenants.from_config(sc)
        if not is_loopback(sc.host) and self.tenants.open:
            raise ConfigError(
                f"server.host = {sc.host!r}: a server reachable from other hosts needs server.token "
                "or server.tenants (or bind to 127.0.0.1)"
            )
        if sc.metrics_auth and not self.tenants.admin_token:
            raise ConfigError("server.metrics_auth: scrapes present server.token (server.admin_token with tenants), "
                              "which is not set")
        if sc.metrics_port is not None and not is_loopback(sc.metrics_host) and not sc.metrics_auth:
            log.warning("lmkv serve: metrics on %s without server.metrics_auth: anyone who reaches it reads "
                        "every counter", sc.metrics_host)
        if bool(sc.tls_cert) != bool(sc.tls_key):
            raise ConfigError("server.tls_cert and server.tls_key go together")
        if cfg.memory.pin == "auto":  # (its arena never meets a GPU; asking whether one is there imports torch)
            cfg = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"pin": "never"})})
        self.cfg = cfg
        self.store = TieredStore(cfg, accounts={tier: self.tenants.accounts(tier) for tier in ("memory", "disk")})
        self.counters = {t.name: Counters() for t in self.tenants.tenants}
        self.stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(sc.max_connections)
        # connections not authenticated yet, oldest first (id of the raw socket -> it, its peer)
        self._pending: OrderedDict[int, tuple[socket.socket, str]] = OrderedDict()
        self._peers = Counts(lambda _: sc.max_per_peer)
        holders = [t for t in self.tenants.tenants if t.holds_pages]
        share = max(1, sc.max_connections // max(1, len(holders)))
        caps = {t.name: t.quota.connections or (share if t.holds_pages else sc.max_connections)
                for t in self.tenants.tenants}
        self._tenant_conns = Counts(caps.__getitem__)
        self.auth_failures = AuthFailures()
        self._clients: set[Client] = set()
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        if sc.tls_cert:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(sc.tls_cert, sc.tls_key)
        self.sock = socket.create_server((sc.host, sc.port), backlog=128, reuse_port=False)
        self.port = self.sock.getsockname()[1]
        # Same-host clients: an abstract Unix socket (no file to squat or to chmod), its name
        # random and told only to clients that reached the TCP port from this host.
        self.unix: socket.socket | None = None
        self.unix_name: str | None = None
        self.shm_uids = set(sc.shm_uids if sc.shm_uids is not None else [os.geteuid()])
        self.arenas = Arenas()
        if sc.shared_memory:
            self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.unix_name = f"\0lmkv-serve-{os.getpid()}-{secrets.token_hex(8)}"
            self.unix.bind(self.unix_name)
            self.unix.listen(128)
        self._metrics_server = None
        if sc.metrics_port is not None:
            token = self.tenants.admin_token if sc.metrics_auth else None
            self._metrics_server = serve_metrics(self.store.metrics.registry, sc.metrics_host, sc.metrics_port, token)
            self.metrics_port = self._metrics_server.server_port

    def serve_forever(self) -> None:
        log.info("lmkv serve: listening on %s:%d (tiers: %s)", self.cfg.server.host, self.port,
                 ", ".join(t.name for t in self.store.tiers))
        if self.unix is not None:
            threading.Thread(target=self._accept, args=(self.unix, True), daemon=True,
                             name="lmkv-serve-unix").start()
        self._accept(self.sock, False)

    def _accept(self, listener: socket.socket, unix: bool) -> None:
        listener.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            threading.Thread(target=self._serve_one, args=(conn, addr, unix), daemon=True,
                             name="lmkv-serve-unix" if unix else f"lmkv-serve-{addr[0]}:{addr[1]}").start()

    def _serve_one(self, conn: socket.socket, addr, unix: bool = False) -> None:
        """One connection, through admission (:mod:`lmkv.serve.admission`): a per-peer count, an
        unauthenticated slot with a deadline for HELLO, then a client slot once HELLO succeeded."""
        sc = self.cfg.server
        uid = None
        if unix:
            pid, uid, _ = shm_window.peer_credentials(conn)
            peer, origin = f"unix:pid={pid},uid={uid}", f"uid:{uid}"
        else:
            peer, origin = f"{addr[0]}:{addr[1]}", addr[0]
        if not self._peers.enter(origin):
            self._refuse(conn, peer, f"too many connections from {origin}")
            return
        holder: list[Client] = []
        try:
            raw = conn
            self._await_hello(raw, peer)
            timer = threading.Timer(sc.hello_timeout, self._expire, (raw, holder, peer))
            timer.daemon = True
            timer.start()
            try:
                conn.settimeout(sc.hello_timeout)
                if not unix:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls is not None and not unix:
                    try:
                        conn = self._tls.wrap_socket(conn, server_side=True)
                    except (ssl.SSLError, OSError) as e:
                        log.info("lmkv serve: %s: TLS handshake failed (%s)", peer, e)
                        conn.close()
                        return
                client = Client(self, conn, peer, origin, id(raw), unix_uid=uid,
                                local=not unix and self.unix_name is not None and is_loopback(addr[0]))
                holder.append(client)
                with self._lock:
                    self._clients.add(client)
                try:
                    client.serve()
                except LMKVError:
                    log.exception("lmkv serve: %s: request failed", peer)
                finally:
                    with self._lock:
                        self._clients.discard(client)
            finally:
                timer.cancel()
                if holder and holder[0].authenticated:
                    self._slots.release()
                    assert holder[0].tenant is not None
                    self._tenant_conns.leave(holder[0].tenant.name)
                else:
                    self._drop_pending_key(id(raw))
        finally:
            if not (holder and holder[0].authenticated):  # (an authenticated one left its peer's count)
                self._peers.leave(origin)

    def stats(self, tenant: Tenant | None) -> dict[str, dict[str, int]]:
        """STATS: a tenant sees its own pages, quota and counters; ``None`` (admin) the whole server
        and every tenant's summary."""
        if tenant is not None:
            return self._tenant_stats(tenant)
        out = self.store.stats()
        for t in self.tenants.tenants:
            if t.holds_pages:
                out[f"tenant:{t.name}"] = self._tenant_stats(t)["tenant"]
        return out

    def _tenant_stats(self, tenant: Tenant) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        pages = used = 0
        for tier in self.store.local_tiers:
            u, lim = tier.usage(tenant.tag), tier.limit(tenant.tag) or Limit()
            out[tier.name] = {"pages": u.pages, "used_bytes": u.bytes, "quota_pages": lim.pages or 0,
                              "capacity_bytes": min(lim.bytes or tier.capacity_bytes, tier.capacity_bytes)}
            pages, used = pages + u.pages, used + u.bytes
        out["tenant"] = {**vars(self.counters[tenant.name]), "pages": pages, "used_bytes": used,
                         "domains": len(self.store.domains(tenant.tag)), "quota_domains": tenant.quota.domains}
        return out

    def admit(self, client: Client) -> None:
        """HELLO succeeded: the connection trades its unauthenticated slot and its place in its peer's
        count for a place in its tenant's count and a client slot."""
        tenant = client.tenant
        assert tenant is not None
        if not self._tenant_conns.enter(tenant.name):
            log.warning("lmkv serve: refusing %s: tenant %r has %d connections, its quota", client.peer,
                        tenant.name, self._tenant_conns.limit(tenant.name))
            raise Fatal(f"tenant {tenant.name!r} has {self._tenant_conns.limit(tenant.name)} connections open, "
                        "its quota (quota.connections)")
        if not self._slots.acquire(blocking=False):
            self._tenant_conns.leave(tenant.name)
            log.warning("lmkv serve: refusing %s: %d clients connected", client.peer, self.cfg.server.max_connections)
            raise Fatal("server full: too many connections")
        client.authenticated = True
        self._peers.leave(client.origin)
        self._drop_pending_key(client.pending_key)
        client.arm_timeout()

    def _await_hello(self, raw: socket.socket, peer: str) -> None:
        """Count a new connection as unauthenticated; when too many are, the oldest goes: a client
        that authenticates does so in milliseconds, so connections held open without HELLO can
        never keep new clients out (refusing the newest would)."""
        evicted = None
        with self._lock:
            if len(self._pending) >= self.cfg.server.max_unauthenticated:
                _, evicted = self._pending.popitem(last=False)
            self._pending[id(raw)] = (raw, peer)
        if evicted is not None:
            log.info("lmkv serve: %d connections await authentication; closing the oldest, %s",
                     self.cfg.server.max_unauthenticated, evicted[1])
            try:
                evicted[0].shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _drop_pending_key(self, key: int) -> None:
        with self._lock:
            self._pending.pop(key, None)

    @staticmethod
    def _expire(raw: socket.socket, holder: list[Client], peer: str) -> None:
        """The HELLO deadline passed: a connection still not authenticated is cut off (however
        slowly its bytes trickled in)."""
        if not (holder and holder[0].authenticated):
            log.info("lmkv serve: %s did not authenticate in time; closing it", peer)
            try:
                raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def _refuse(conn: socket.socket, peer: str, why: str) -> None:
        log.warning("lmkv serve: refusing %s: %s", peer, why)
        try:
            conn.settimeout(1.0)
            conn.sendall(frame(1, encode(ErrorReply(why))))
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        """Stop accepting, close every client, flush and close the tiers."""
        self.stopping.set()
        for listener in (self.sock, self.unix):
            try:
                if listener is not None:
                    listener.close()
            except OSError:
                pass
        with self._lock:
            clients = list(self._clients)
        for c in clients:
            c.revoke()  # (its client takes the connection's end to mean its memory is no longer touched)
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.store.close()


def serve(cfg: LMKVConfig) -> int:
    """Run until SIGINT/SIGTERM."""
    server = Server(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stopping.set())
    print(f"lmkv serve: lmkv://{cfg.server.host}:{server.port}" + (f" (pid {os.getpid()})"), flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop()
    return 0
