"""Shared fixtures: small layouts, payloads, and a small real tmpfs for disk-full tests."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid

import numpy as np
import pytest

from lmkv.layout import GroupLayout, Segment, StateKind, attention_layout


@pytest.fixture
def layout() -> GroupLayout:
    """4 layers x (K, V) of 8 KiB: a 64 KiB page."""
    return attention_layout("attn", num_layers=4, tokens_per_page=32, num_kv_heads=2, head_size=64,
                            dtype_bytes=2, dtype="bfloat16")


@pytest.fixture
def mamba_layout() -> GroupLayout:
    return GroupLayout("mamba", StateKind.MAMBA, num_layers=3,
                       segments=(Segment("conv", 3000), Segment("ssm", 5096)),
                       tokens_per_page=64, dtype="float32", tp_size=2, tp_rank=1, tp_replicas=1)


def random_payload(layout: GroupLayout, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, layout.payload_bytes, dtype=np.uint8)


def random_key() -> bytes:
    return os.urandom(16)


def make_pages(layout: GroupLayout, n: int, seed: int = 0):
    """``n`` random pages: their keys, payloads, and (header, payload) pairs ready for ``Tier.put``."""
    from lmkv.page import make_header

    keys = [random_key() for _ in range(n)]
    payloads = [random_payload(layout, seed + i) for i in range(n)]
    return keys, payloads, [(make_header(k, layout, p), p) for k, p in zip(keys, payloads)]


def raw_redis(url: str):
    """A plain redis-py client of the Redis (or cluster) at ``url``, to see or damage what lmkv stored."""
    import redis

    if url.startswith("redis-cluster://"):
        host, port = url.removeprefix("redis-cluster://").split(",")[0].split(":")
        return redis.RedisCluster(host=host, port=int(port))
    return redis.Redis.from_url(url)


def reads_back(source, keys, layout: GroupLayout, payloads) -> bool:
    """Whether every page of ``keys`` reads back from ``source`` (a tier or a store) as ``payloads``."""
    outs = [np.zeros(layout.payload_bytes, np.uint8) for _ in keys]
    got = source.get(keys, layout, outs)
    return all(h is not None for h in got) and all(np.array_equal(o, p) for o, p in zip(outs, payloads))


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs: a real file system that fills up. Needs root (CI runs as root)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="session")
def redis_node():
    """A real redis-server on a loopback port for the whole session."""
    from lmkv.dev.redis_server import start_redis

    with start_redis() as r:
        yield r


@pytest.fixture(scope="session")
def mooncake_master():
    """A real mooncake_master on a loopback port for the whole session, with a storage client
    (``mooncake_client``) holding 256 MiB of the pool: pages outlive the store that wrote them."""
    pytest.importorskip("mooncake.store")
    from lmkv.dev.mooncake_master import start_master, start_storage

    with start_master() as m, start_storage(m, 256 << 20):
        yield m


#: a Mooncake client of the session's master: it contributes no memory (the storage client holds the pages)
MOONCAKE_SMALL = {"segment_size": 0, "local_buffer_size": 16 << 20, "staging_size": 8 << 20}


@pytest.fixture(scope="session")
def redis_cluster():
    """A real three-node Redis Cluster on loopback ports."""
    from lmkv.dev.redis_server import start_cluster

    with start_cluster(3) as c:
        yield c


def flip_byte(path, offset: int) -> None:
    """Corrupt one byte of a file in place (a page's checksum then fails)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def layerwise_load(store, layouts, tensors, names, op):
    """A worker that loads ``op`` into ``tensors`` layer by layer, as the forward's hooks run."""
    from lmkv.engine.plan import StepPlan
    from lmkv.engine.worker import LayerwiseTransfer

    r = LayerwiseTransfer(store, layouts, tensors, names)
    r.begin(StepPlan(loads=[op]))
    r.start_loads()
    for name in names:
        r.before_layer(name)
    r.end()
    return r


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """vLLM's ModelConfig of a 2-layer Llama made here, for tests on vLLM's real scheduler."""
    from support.scheduler_harness import HEADS
    from vllm.config import ModelConfig

    from lmkv.dev.tinymodels import make_llama

    path = make_llama(root=tmp_path_factory.mktemp("models"), num_hidden_layers=2, num_key_value_heads=HEADS,
                      num_attention_heads=4, hidden_size=256)
    return ModelConfig(model=str(path), dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=1024)


@pytest.fixture
def silent_listener():
    """A TCP port that accepts connections and never answers (a hung backend)."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    yield srv.getsockname()[1]
    stop.set()
    th.join()
    for c in conns:
        c.close()
    srv.close()
