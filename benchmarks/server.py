"""``lmkv bench server``: the lmkv server beside a raw loopback socket and memcpy, plus a load test.

``lmkv serve`` runs in its own process, as in production. Per round:

- ``server.tcp.put.2MiB`` / ``server.tcp.get.2MiB``: ``ServerTier.put`` / ``get``
  of 2 MiB pages over TCP (one request per batch, every page verified on get);
  baseline: a raw loopback socket between two processes moving the same bytes
  in the same batches (``sendall`` / ``recv_into`` a preallocated buffer, one ack).
- ``server.shm.get.2MiB``: the same get on the same host, into buffers in the
  client's shared arena (what a store's memory tier is when its remote is an lmkv
  server on this host): the server copies each page straight into place;
  baseline: a numpy memcpy of the same bytes. ``server.shm_staged.*``: buffers
  outside the arena, staged through the connection's window (two copies).
- ``server.exists``: single-key ``contains`` calls per second (a round trip each).
- ``load.*``: :func:`lmkv.dev.load_test.run_load`, N clients for M seconds of mixed
  put / get / exists; every page read back is compared byte for byte.
- ``load.slowloris_served``: a client's completed requests (each on a fresh connection: connect,
  HELLO, EXISTS, close) while 256 connections are held open without ever saying HELLO;
  baseline: the same client alone, same run.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.benchmarks.tiers import aligned_buffers, bench_layout, random_keys
from lmkv.config import RemoteConfig
from lmkv.dev.load_test import run_load
from lmkv.dev.server_process import spawn
from lmkv.page import make_header
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import TierStats
from lmkv.tiers.quarantine import Quarantine
from lmkv.tiers.server_client import ServerTier
from lmkv.wire.protocol import PROTOCOL_VERSION, Hello, Keys, Op, encode, frame, read_frame, recv_exact

log = logging.getLogger("lmkv.bench.server")

PAGE = 2 << 20
#: a plain-server request: op (1 sink, 2 source) and its byte count
CMD = struct.Struct("<BQ")


def raw_peer() -> None:
    """The baseline's other process, a plain threaded socket server: on each connection (a thread
    each), sinks or sources the bytes asked for, into/from one buffer."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=256)
    print(srv.getsockname()[1], flush=True)
    buf = memoryview(bytearray(os.urandom(256 << 20)))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = memoryview(bytearray(CMD.size))
        with conn:
            while True:
                try:
                    recv_exact(conn, head)
                except Exception:
                    return
                op, n = CMD.unpack(head)
                n = min(n, len(buf))
                if op == 1:  # sink n bytes into distinct pages of the buffer, then ack
                    for off in range(0, n, PAGE):
                        recv_exact(conn, buf[off : off + min(PAGE, n - off)])
                    conn.sendall(b"k")
                else:  # source n bytes from distinct pages (as a server sends distinct pages, not one hot one)
                    for off in range(0, n, PAGE):
                        conn.sendall(buf[off : off + min(PAGE, n - off)])

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _fresh_connection_ops(port: int, seconds: float) -> int:
    """Requests completed in ``seconds``, each on a new connection (what admission decides about)."""
    hello = frame(Op.HELLO, encode(Hello(PROTOCOL_VERSION, "bench")))
    exists = frame(Op.EXISTS, encode(Keys([b"k" * 16])))
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(hello)
                if read_frame(c, 1 << 20)[0] != 0:
                    continue
                c.sendall(exists)
                if read_frame(c, 1 << 20)[0] == 0:
                    done += 1
        except OSError:
            continue
    return done


def _slowloris_served(port: int, seconds: float, held: int = 256) -> tuple[int, int]:
    """(requests completed while ``held`` connections sit open without HELLO, requests alone)."""
    alone = _fresh_connection_ops(port, seconds)
    sockets = []
    try:
        for _ in range(held):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        attacked = _fresh_connection_ops(port, seconds)
    finally:
        for h in sockets:
            h.close()
    return attacked, alone


def run(quick: bool = False, directory: str | None = None) -> Report:
    n, rounds = (12, 3) if quick else (32, 7)
    load_clients, load_seconds = (4, 3.0) if quick else (8, 15.0)
    lay = bench_layout(PAGE)
    report = Report("server", params={"page_bytes": PAGE, "pages_per_batch": n, "rounds": rounds,
                                      "load_clients": load_clients, "load_seconds": load_seconds})
    payloads = aligned_buffers(n, PAGE, fill=True)
    outs = aligned_buffers(n, PAGE, fill=False)
    keys = random_keys(n)
    pages = [(make_header(k, lay, p), p) for k, p in zip(keys, payloads)]
    peer = subprocess.Popen([sys.executable, "-c", "from lmkv.benchmarks.server import raw_peer; raw_peer()"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        raw = socket.create_connection(("127.0.0.1", int(peer.stdout.readline())))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = memoryview(bytearray(1))

        def raw_put() -> float:
            def go():
                raw.sendall(CMD.pack(1, n * PAGE))
                for p in payloads:
                    raw.sendall(p.data)
                recv_exact(raw, ack)
            return gbps(n * PAGE, timed(go))

        def raw_get() -> float:
            def go():
                raw.sendall(CMD.pack(2, n * PAGE))
                for o in outs:
                    recv_exact(raw, o.data)
            return gbps(n * PAGE, timed(go))

        with spawn("--memory", "2GiB") as server:
            tcp = ServerTier(RemoteConfig(url=server.url, shm="never"))
            shm = ServerTier(RemoteConfig(url=server.url, shm="auto"))
            arena = HostArena(n * PAGE, "never", shared=True)
            shm.share_arena(arena, Quarantine(threading.Lock(), lambda *_: None, n * PAGE, TierStats()))
            arena_outs = [arena.buf[i * PAGE : (i + 1) * PAGE] for i in range(n)]
            arena_srcs = [arena.buf[(n - 1 - i) * PAGE : (n - i) * PAGE] for i in range(n)]
            assert all(tcp.put(pages, "bench"))

            def put() -> float:
                return gbps(n * PAGE, timed(lambda: tcp.put(pages, "bench")))

            def get() -> float:
                return gbps(n * PAGE, timed(lambda: tcp.get(keys, lay, outs)))

            def shm_get() -> float:
                return gbps(n * PAGE, timed(lambda: shm.get(keys, lay, arena_outs)))

            def staged_get() -> float:
                return gbps(n * PAGE, timed(lambda: shm.get(keys, lay, outs)))

            def shm_put() -> float:
                return gbps(n * PAGE, timed(lambda: shm.put(arena_pages, "bench")))

            def staged_put() -> float:
                return gbps(n * PAGE, timed(lambda: shm.put(pages, "bench")))

            def memcpy() -> float:
                def copy() -> None:
                    for o, p in zip(outs, payloads):
                        np.copyto(o, p)

                return gbps(n * PAGE, timed(copy))

            tput, bput = interleaved(rounds, put, raw_put)
            tget, bget = interleaved(rounds, get, raw_get)
            for s_, p in zip(arena_srcs, payloads):
                s_[:] = p
            arena_pages = [(h, s_) for (h, _), s_ in zip(pages, arena_srcs)]
            sget, stget, sput, stput, mc = interleaved(rounds, shm_get, staged_get, shm_put, staged_put, memcpy)
            assert all(np.array_equal(o, p) for o, p in zip(outs, payloads))
            assert all(np.array_equal(o, p) for o, p in zip(arena_outs, payloads))
            with shm._conn() as c:
                if c.window is None:
                    report.params["shm"] = "unavailable: the server could not map the window"
            calls = 2000 if not quick else 500
            t = timed(lambda: [tcp.contains(keys[:1]) for _ in range(calls)])
            exists = calls / t
            t = timed(lambda: [tcp.contains(keys * 2) for _ in range(calls // 10)])
            exists_batch = (calls // 10) * 2 * n / t
            wtcp = "raw loopback socket between two processes, same bytes and batches, same run"
            report.add("server.tcp.put.2MiB", tput, "GB/s", bput, wtcp)
            report.add("server.tcp.get.2MiB", tget, "GB/s", bget, wtcp)
            report.add("server.shm.get.2MiB", sget, "GB/s", mc, "numpy memcpy of the same bytes, same run")
            report.add("server.shm.put.2MiB", sput, "GB/s", mc, "numpy memcpy of the same bytes, same run")
            report.add("server.shm_staged.get.2MiB", stget, "GB/s", mc, "numpy memcpy of the same bytes, same run")
            report.add("server.shm_staged.put.2MiB", stput, "GB/s", mc, "numpy memcpy of the same bytes, same run")
            report.add("server.exists", exists, "ops/s")
            report.add(f"server.exists.batch{2 * n}", exists_batch, "keys/s")
            tcp.close()
            shm.close()
            log.info("load test: %d clients for %.0f s", load_clients, load_seconds)
            res = run_load(server.url, load_clients, load_seconds, bench_layout(256 << 10), keys_per_client=32)
            report.add("load.pages_checked", res.pages_checked, "pages")
            report.add("load.lost_pages", res.lost, "pages")
            report.add("load.corrupt_pages", res.corrupt, "pages")
            report.add("load.errors", res.errors, "requests")
            report.add("load.ops_per_s", res.ops / load_seconds, "requests/s")
            report.add("load.server_evictions", res.server_evictions, "pages")
            report.add("load.server_memory_used", res.server_memory_used, "bytes")
            report.params["load_server_memory_capacity"] = res.server_memory_capacity
            if res.notes:
                report.params["load_notes"] = res.notes[:5]
            attacked, alone = _slowloris_served(server.port, 2.0 if quick else 5.0)
            report.add("load.slowloris_served", attacked, "requests", alone or None,
                       "the same client alone, same run (each request on a fresh connection)")
        raw.close()
    finally:
        peer.kill()
        peer.wait()
    return report
