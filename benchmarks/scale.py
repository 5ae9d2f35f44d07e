"""``lmkv bench scale``: what lmkv costs as prompts, tiers and tier populations grow.

- ``scale.lookup_first.131k`` / ``scale.lookup_step.131k.{held,missing,view}``: the scheduler's
  lookup of one waiting 131,072-token prompt (4,096 pages of 32 tokens), its first and (median)
  every later step's, through :meth:`OffloadScheduler.lookup` as an engine adapter calls it.
  ``held``: every page in the memory tier of a store with a disk tier; ``missing``: no tier holds
  any (the disk tier holds other pages); ``view``: a scheduler whose workers live in other
  processes (:class:`~lmkv.engine.residency.ResidencyMirror` over the disk directory, every page
  on disk). Other requests keep storing pages between steps (what an engine does), so a lookup
  cannot take an unchanged tier for granted.
- ``scale.disk_open.100k``: from constructing a disk tier over 100,000 page files until it
  answers its first lookup; baseline: the full rebuild of its index from the files (until every
  page is indexed), same run.
- ``scale.memory_index.1M``: put and lookup µs per page into a memory tier holding 1M pages;
  baseline: the same at 10k pages. ``.lookup.vs_dict``: the lookup at 1M pages against a plain
  ``dict`` of the same keys asked the same keys (what the tier adds to a hash table);
  ``.dict``: that dict at 1M keys against one of 10k (how a hash table's lookups grow on this
  host's caches, whoever owns it).
- ``server.get.{64KiB,2MiB}.{1,8,64}``: one-page GETs (checksums verified) by 1, 8 and 64 clients
  at once, each with its own connection (threads over a few processes), from one ``lmkv serve``;
  baseline: a plain threaded socket server sending the same bytes per request, same run, the two
  in turn for a few rounds (medians: on a 2-core host the same measurement varied 1.5x from one
  window to the next).
- ``server.get.64KiB.{1,8,64}.lean``: where Python's own floor is for those GETs on this host: a
  lean pair in Python speaking the same wire format (one ``recv_into`` a frame, msgspec, the
  header's check and every unit's digest on the client; a dict and one ``sendmsg`` on the server;
  no authentication, pool, store, pins, quotas or stats) against the plain pair, same rounds.
- ``server.shm.get_batch``: a GET of 64 pages of 64 KiB from a server on this host into the
  client's shared arena; baseline: the same GET over TCP (medians of samples of 8 GETs each).
- ``server.write_through.4MiB{,.tcp}``: a step's write-through of 32 pages of 4 MiB to the server,
  from its commit until the server holds them all, the server on this host (shared memory) and
  over TCP (``.tcp``, as to another host); baseline: the same bytes sent to the plain server and
  acknowledged.
- ``server.idle_rss``: the resident memory of an ``lmkv serve`` that has served nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from functools import partial

import msgspec
import numpy as np

from lmkv.benchmarks.report import Report, gbps, interleaved, timed
from lmkv.benchmarks.server import CMD
from lmkv.benchmarks.tiers import bench_layout, random_keys
from lmkv.config import DiskConfig, MemoryConfig, RemoteConfig, load_config
from lmkv.dev.server_process import spawn
from lmkv.engine.residency import ResidencyMirror
from lmkv.engine.scheduler import OffloadScheduler
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, header_of_digests, make_header, packed_as, unpack_header, verify_payload
from lmkv.store import TieredStore
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import TierStats
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.memory import MemoryTier
from lmkv.tiers.page_files import DiskView
from lmkv.tiers.quarantine import Quarantine
from lmkv.tiers.server_client import ServerTier
from lmkv.wire.protocol import FRAME, FRAME_BYTES, MAGIC, Get, GetReply, LayoutMsg, Op, recv_exact

log = logging.getLogger("lmkv.bench.scale")

TPP = 32
PROMPT = 131072
OTHER_PAGES = 64  # pages other requests store between two lookups
CLIENT_PROCESSES = 4  # GET clients are threads spread over this many processes


def _layout(page_bytes: int) -> GroupLayout:
    return replace(bench_layout(page_bytes), tokens_per_page=TPP)


def _pages(keys, lay: GroupLayout) -> list:
    payload = np.zeros(lay.payload_bytes, np.uint8)
    digests = make_header(keys[0], lay, payload).digests
    return [(header_of_digests(k, lay, digests), payload) for k in keys]


def _steps(residency, lay: GroupLayout, tokens: list[int], churn, steps: int) -> tuple[float, list[float]]:
    """First lookup and each later step's, with ``churn()`` (other requests' stores) between steps."""
    sched = OffloadScheduler(residency, [lay], TPP, "bench", "default")
    st = sched.track("r")
    t0 = time.perf_counter()
    sched.lookup(st, tokens, 0)
    first = time.perf_counter() - t0
    took = []
    for _ in range(steps):
        churn()
        t0 = time.perf_counter()
        sched.lookup(st, tokens, 0)
        took.append(time.perf_counter() - t0)
    sched.close()
    return first, took


def _lookups(report: Report, steps: int) -> None:
    lay = _layout(16 << 10)
    tokens = np.random.default_rng(0).integers(0, 50_000, PROMPT).tolist()
    probe = OffloadScheduler(ResidencyMirror(), [lay], TPP, "bench", "default")
    seq = probe.track("r").seq
    seq.extend(tokens)
    keys = seq.keys(lay, 0, PROMPT // TPP - 1)
    root = tempfile.mkdtemp(prefix="lmkv-scale-")
    try:
        cfg = load_config({"memory": {"capacity": "256MiB"}, "disk": {"path": root, "capacity": "2GiB"}},
                          environ={})
        with TieredStore(cfg) as store:
            store.put_pages(_pages(random_keys(256), lay))  # the disk tier holds other pages (write-through)
            store.drain()
            other = iter(random_keys(OTHER_PAGES * (steps + 1) * 4))

            def churn() -> None:
                store.put_pages(_pages([next(other) for _ in range(OTHER_PAGES)], lay))

            first, missing = _steps(store, lay, tokens, churn, steps)
            store.put_pages(_pages(keys, lay))
            store.drain()
            _, held = _steps(store, lay, tokens, churn, steps)
            view_of_disk = DiskView(root)
            view_of_disk.wait_indexed()
            _, view = _steps(ResidencyMirror([view_of_disk]), lay, tokens, churn, steps)
            view_of_disk.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.add("scale.lookup_first.131k", first, "s")
    for name, took in (("held", held), ("missing", missing), ("view", view)):
        report.add(f"scale.lookup_step.131k.{name}", statistics.median(took), "s")


def _disk_open(report: Report, pages: int) -> None:
    lay = _layout(4 << 10)
    root = tempfile.mkdtemp(prefix="lmkv-scale-disk-")
    cfg = DiskConfig(path=root, capacity=str(pages * 16 << 10))
    try:
        keys = random_keys(pages)
        tier = DiskTier(cfg)
        for i in range(0, pages, 1024):
            tier.put(_pages(keys[i : i + 1024], lay), "engine")
        tier.close()
        t0 = time.perf_counter()
        tier = DiskTier(cfg)
        found = tier.contains(keys[:1])
        answered = time.perf_counter() - t0
        tier.wait_indexed()
        rebuilt = time.perf_counter() - t0
        indexed = len(tier)
        tier.close()
        if not found[0] or indexed != pages:
            raise RuntimeError(f"disk tier reopened with {indexed} of {pages} pages")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.add("scale.disk_open.100k", answered, "s", rebuilt, "full index rebuild from the files, same run")


def _memory_index(report: Report, big: int, small: int) -> None:
    """Filled to ``big`` (and ``small``) pages untimed, then 8,192 more pages put and 8,192 held
    pages looked up, timed: the index's cost per page once it holds that many (the lookups in
    turns with a plain dict's of the same keys)."""
    lay = _layout(4 << 10)  # (the smallest slot: the index is what is measured, not the copies)
    probe = 8192

    def per_page(n: int) -> tuple[float, float, float]:
        room = (n + probe) * lay.payload_bytes * 21 // 20 + (64 << 20)  # (no eviction: the index alone)
        tier = MemoryTier(MemoryConfig(capacity=str(room), pin="never", prefault=True))
        keys = random_keys(n + probe)
        for i in range(0, n, 4096):
            tier.put(_pages(keys[i : min(n, i + 4096)], lay), "engine")
        fresh = _pages(keys[n:], lay)
        t0 = time.perf_counter()
        for i in range(0, probe, 1024):
            tier.put(fresh[i : i + 1024], "engine")
        t_put = time.perf_counter() - t0
        held = [keys[i] for i in np.random.default_rng(1).integers(0, n, probe)]
        plain = dict.fromkeys(keys)
        # (in turns: the same lookups measured a minute apart varied 2x here)
        t_look, t_dict = interleaved(9, lambda: timed(lambda: tier.contains(held)),
                                     lambda: timed(lambda: [k in plain for k in held]))
        if not all(tier.contains(held)) or tier.stats.evictions:
            raise RuntimeError("the memory tier lost pages while its index was measured")
        tier.close()
        return t_put / probe * 1e6, t_look / probe * 1e6, t_dict / probe * 1e6

    put_big, look_big, dict_big = per_page(big)
    put_small, look_small, dict_small = per_page(small)
    what = f"the same at {small} pages, same run"
    report.add("scale.memory_index.1M", put_big, "µs/page (put)", put_small, what)
    report.add("scale.memory_index.1M.lookup", look_big, "µs/page (lookup)", look_small, what)
    report.add("scale.memory_index.1M.lookup.vs_dict", look_big, "µs/page (lookup)", dict_big,
               f"a plain dict of the same {big} keys asked the same keys, same run")
    report.add("scale.memory_index.1M.dict", dict_big, "µs/key (lookup)", dict_small,
               f"a plain dict of {small} keys, same run (a hash table's growth on this host's caches)")


def run(quick: bool = False) -> Report:
    disk_pages, memory_pages = (20_000, 200_000) if quick else (100_000, 1_000_000)
    report = Report("scale", params={"prompt_tokens": PROMPT, "tokens_per_page": TPP,
                                     "disk_open_pages": disk_pages, "memory_index_pages": memory_pages})
    _lookups(report, steps=10 if quick else 30)
    _disk_open(report, disk_pages)
    _memory_index(report, memory_pages, 10_000)
    _server(report, quick)
    return report


# -- lmkv serve beside a plain socket server ----------------------------------------------------

def _plain_get_loop(port: int, page: int, until: float) -> int:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = memoryview(bytearray(page))
        cmd = CMD.pack(2, page)
        n = 0
        while time.time() < until:
            c.sendall(cmd)
            recv_exact(c, out)
            n += 1
        return n


def lean_peer() -> None:
    """The lean pair's server (its own process): reads ``{"page", "keys"}`` as JSON on stdin, holds
    those pages (the bench's payload) in a dict and answers one-page GETs in lmkv's wire format,
    a thread a connection; prints its port."""
    job = json.loads(sys.stdin.readline())
    lay = bench_layout(job["page"])
    pages = _lean_pages(lay, job["keys"])
    srv = socket.create_server(("127.0.0.1", 0), backlog=256)
    print(srv.getsockname()[1], flush=True)
    decoder, encoder = msgspec.msgpack.Decoder(Get), msgspec.msgpack.Encoder()

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(8 << 10))
        with conn:
            while (got := _lean_frame(conn, buf, 0)) is not None:
                req = decoder.decode(buf[FRAME_BYTES : got[0]])
                header, payload = pages[req.keys[0]]
                meta = encoder.encode(GetReply([packed_as(header, req.keys[0])]))
                conn.sendmsg([FRAME.pack(MAGIC, 0, len(meta), len(payload)) + meta, payload])

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _lean_pages(lay: GroupLayout, keys_hex: list[str]) -> dict[bytes, tuple[PageHeader, memoryview]]:
    payload = np.random.default_rng(0).integers(0, 256, lay.payload_bytes, dtype=np.uint8)
    header = make_header(PageKey(bytes.fromhex(keys_hex[0])), lay, payload)
    return {k: (header_of_digests(PageKey(k), lay, header.digests), payload.data)
            for k in map(bytes.fromhex, keys_hex)}


def _lean_frame(sock: socket.socket, buf: memoryview, have: int) -> tuple[int, int] | None:
    """Receive until ``buf`` (holding ``have`` bytes) has a whole frame head and metadata: (where
    the metadata ends, the bytes ``buf`` holds); None: the peer closed."""
    while have < FRAME_BYTES or have < FRAME_BYTES + FRAME.unpack_from(buf)[2]:
        got = sock.recv_into(buf[have:])
        if not got:
            return None
        have += got
    return FRAME_BYTES + FRAME.unpack_from(buf)[2], have


def _lean_get_loop(port: int, page: int, keys: list[PageKey], until: float) -> int:
    """The lean pair's client: each page asked for, received into one buffer and verified."""
    lay = bench_layout(page)
    msg = LayoutMsg.of(lay)
    decoder, encoder = msgspec.msgpack.Decoder(GetReply), msgspec.msgpack.Encoder()
    buf, out = memoryview(bytearray(8 << 10)), memoryview(bytearray(page))
    n = 0
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.settimeout(30.0)  # (as a client that must not hang does)
        while time.time() < until:
            key = keys[n % len(keys)]
            meta = encoder.encode(Get([key], msg))
            c.sendall(FRAME.pack(MAGIC, Op.GET, len(meta), 0) + meta)
            frame = _lean_frame(c, buf, 0)
            if frame is None:
                raise RuntimeError("the lean server hung up")
            meta_at, have = frame
            header = unpack_header(decoder.decode(buf[FRAME_BYTES:meta_at]).headers[0], key, lay)
            got = have - meta_at
            out[:got] = buf[meta_at:have]
            while got < page:
                got += c.recv_into(out[got:])
            verify_payload(header, lay, out)
            n += 1
    return n


def _lmkv_get_loop(url: str, page: int, keys: list[PageKey], until: float) -> int:
    tier = ServerTier(RemoteConfig(url=url, shm="never", max_connections=1), "bench")
    lay = bench_layout(page)
    out = [np.zeros(page, np.uint8)]
    n = 0
    while time.time() < until:
        if tier.get([keys[n % len(keys)]], lay, out)[0] is None:
            raise RuntimeError("lmkv serve lost a page")
        n += 1
    tier.close()
    return n


def client_process() -> None:
    """One client process (its own interpreter): reads what to do as JSON on stdin, runs that many
    clients (threads, each with its own connection) until the end, prints how many GETs they made."""
    job = json.loads(sys.stdin.read())
    keys = [PageKey(bytes.fromhex(k)) for k in job["keys"]]
    while time.time() < job["start"]:
        time.sleep(0.001)
    until = job["start"] + job["seconds"]
    with futures.ThreadPoolExecutor(job["threads"]) as pool:
        if job["kind"] == "plain":
            done = [pool.submit(_plain_get_loop, int(job["where"]), job["page"], until) for _ in range(job["threads"])]
        elif job["kind"] == "lean":
            done = [pool.submit(_lean_get_loop, int(job["where"]), job["page"], keys, until)
                    for _ in range(job["threads"])]
        else:
            done = [pool.submit(_lmkv_get_loop, job["where"], job["page"], keys, until) for _ in range(job["threads"])]
        print(sum(f.result() for f in done))


def _gets(kind: str, where: str, page: int, clients: int, keys: list[PageKey], seconds: float) -> float:
    """GB/s of one-page GETs by ``clients`` clients at once, spread over a few processes."""
    procs = min(clients, CLIENT_PROCESSES)
    start = time.time() + 2.0  # (every process started and connected)
    running = []
    for i in range(procs):
        job = {"kind": kind, "where": where, "page": page, "threads": clients // procs + (i < clients % procs),
               "keys": [k.hex() for k in keys], "start": start, "seconds": seconds}
        p = subprocess.Popen([sys.executable, "-c", "from lmkv.benchmarks.scale import client_process; "
                              "client_process()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdin is not None
        p.stdin.write(json.dumps(job))
        p.stdin.close()
        running.append(p)
    total = 0
    for p in running:
        assert p.stdout is not None
        out = p.stdout.read()
        if p.wait(120) != 0:
            raise RuntimeError(f"a {kind} client process failed")
        total += int(out)
    return total * page / seconds / 1e9


def _server(report: Report, quick: bool) -> None:
    seconds, rounds = (1.5, 1) if quick else (2.0, 3)
    plain = subprocess.Popen([sys.executable, "-c", "from lmkv.benchmarks.server import raw_peer; raw_peer()"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert plain.stdout is not None
        port = plain.stdout.readline().strip()
        with spawn("--memory", "1GiB") as server:
            what = "a plain threaded socket server moving the same bytes, one request per page, same run"
            for label, page in (("64KiB", 64 << 10), ("2MiB", 2 << 20)):
                lay = bench_layout(page)
                keys = random_keys(16)
                tier = ServerTier(RemoteConfig(url=server.url, shm="never"), "bench")
                payload = np.random.default_rng(0).integers(0, 256, page, dtype=np.uint8)
                tier.put([(make_header(k, lay, payload), payload) for k in keys], "bench")
                tier.close()
                with _lean_server(page, keys) if label == "64KiB" else contextlib.nullcontext() as lean:
                    for clients in (1, 8, 64):
                        runs = [partial(_gets, "lmkv", server.url, page, clients, keys, seconds),
                                partial(_gets, "plain", port, page, clients, keys, seconds)]
                        if lean is not None:
                            runs.append(partial(_gets, "lean", lean, page, clients, keys, seconds))
                        got = interleaved(rounds, *runs)
                        report.add(f"server.get.{label}.{clients}", got[0], "GB/s", got[1], what)
                        if lean is not None:
                            report.add(f"server.get.{label}.{clients}.lean", got[2], "GB/s", got[1],
                                       "the plain pair, same rounds (the lean pair: Python's floor for lmkv's wire "
                                       "format on this host)")
            _batches(report, server.url, 3 if quick else 9)
            _write_through(report, server.url, port, 3 if quick else 7)
        with spawn("--memory", "1GiB") as idle:
            time.sleep(1.0)
            report.add("server.idle_rss", _rss(idle.proc.pid), "bytes")
    finally:
        plain.kill()
        plain.wait()


@contextlib.contextmanager
def _lean_server(page: int, keys: list[PageKey]) -> Iterator[str]:
    """The lean pair's server process holding ``keys``' pages while in use; gives its port."""
    proc = subprocess.Popen([sys.executable, "-c", "from lmkv.benchmarks.scale import lean_peer; lean_peer()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"page": page, "keys": [k.hex() for k in keys]}) + "\n")
        proc.stdin.flush()
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def _rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return float(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024)


def _batches(report: Report, url: str, rounds: int) -> None:
    """A batch of 64 KiB pages in one GET, into a shared arena (same host) and over TCP."""
    page, n = 64 << 10, 64
    repeats = 8  # GETs a sample times (one GET is a few ms: samples of one varied 1.5x from one to the next)
    lay = bench_layout(page)
    keys = random_keys(n)
    payloads = [np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8) for i in range(n)]
    tcp = ServerTier(RemoteConfig(url=url, shm="never"), "bench")
    shm = ServerTier(RemoteConfig(url=url, shm="auto"), "bench")
    tcp.put([(make_header(k, lay, p), p) for k, p in zip(keys, payloads)], "bench")
    arena = HostArena(n * page, "never", shared=True)
    shm.share_arena(arena, Quarantine(threading.Lock(), lambda *_: None, n * page, TierStats()))
    in_arena = [arena.buf[i * page : (i + 1) * page] for i in range(n)]
    outs = [np.zeros(page, np.uint8) for _ in range(n)]

    def over(tier, dst) -> float:
        return gbps(repeats * n * page, timed(lambda: [tier.get(keys, lay, dst) for _ in range(repeats)]))

    s, t = interleaved(rounds, lambda: over(shm, in_arena), lambda: over(tcp, outs))
    if not all(np.array_equal(o, p) for o, p in zip(in_arena, payloads)):
        raise RuntimeError("a shared-memory GET landed wrong bytes")
    report.add("server.shm.get_batch", s, "GB/s", t, f"the same GET of {n} x 64 KiB over TCP, same run")
    for x in (tcp, shm):
        x.close()


def _write_through(report: Report, url: str, port: str, rounds: int) -> None:
    """A step's write-through of 4 MiB pages to lmkv serve: from the step's commit (its pages in the
    memory tier's slots, as the worker leaves them) until the server holds them all. On the server's
    host (``shm: auto``, the default) the server copies from the shared arena; ``.tcp`` (``shm:
    never``): the bytes go over the socket, as to a server on another host."""
    page, n = 4 << 20, 32
    lay = bench_layout(page)
    payloads = [np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8) for i in range(n)]
    what = "the same bytes sent to a plain socket server and acknowledged, same run"
    ack = memoryview(bytearray(1))
    for suffix, shm in (("", "auto"), (".tcp", "never")):
        cfg = load_config({"memory": {"capacity": "512MiB"}, "remote": {"url": url, "shm": shm}}, environ={})
        with TieredStore(cfg) as store, socket.create_connection(("127.0.0.1", int(port))) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def through() -> float:
                keys = [PageKey(os.urandom(16)) for _ in range(n)]
                session = store.open_session(keys, [lay] * n)
                for i, p in enumerate(payloads):
                    np.frombuffer(session.buffer(i), np.uint8)[:] = p
                session.commit()
                assert session.written_through is not None
                took = timed(session.written_through.result)
                if not all(store.tiers[1].contains(keys)):
                    raise RuntimeError("the server lacks pages written through")
                store.delete(keys)
                return gbps(n * page, took)

            def plain() -> float:
                def go() -> None:
                    raw.sendall(CMD.pack(1, n * page))
                    for p in payloads:
                        raw.sendall(p.data)
                    recv_exact(raw, ack)
                return gbps(n * page, timed(go))

            ours, base = interleaved(rounds, through, plain)
        report.add(f"server.write_through.4MiB{suffix}", ours, "GB/s", base, what)
