"""Redis replies read straight into buffers, against a real redis-server, in RESP2 and RESP3."""

from __future__ import annotations

import os
import time

import pytest
import redis
from redis import exceptions as rexc

from lmkv.config import RemoteConfig
from lmkv.tiers.redis import make_client
from lmkv.tiers.redis_reads import read_pipelined


@pytest.mark.parametrize("protocol", [2, 3])
def test_replies_land_in_their_buffers_and_the_connection_stays_in_step(redis_node, protocol):
    """Large values go into their buffers, small ones come back as bytes; nil, an empty range, a
    value of the wrong length (its buffer untouched) and an error each come back as such, and the
    connection answers the next commands in step."""
    client = redis.Redis.from_url(redis_node.url, protocol=protocol)
    tag = f"rr{protocol}-{time.monotonic_ns()}"
    big, small = os.urandom(4 << 20), os.urandom(100)
    client.set(f"{tag}:big", big)
    client.set(f"{tag}:small", small)
    client.hset(f"{tag}:hash", "f", "v")
    whole, part, wrong = bytearray(len(big)), bytearray(1 << 20), bytearray(10)
    commands = [("GET", f"{tag}:small"), ("GET", f"{tag}:big"), ("GETRANGE", f"{tag}:big", 1 << 20, (2 << 20) - 1),
                ("GET", f"{tag}:missing"), ("GETRANGE", f"{tag}:missing", 0, 9), ("GETRANGE", f"{tag}:small", 0, 19),
                ("GET", f"{tag}:hash"), ("GET", f"{tag}:small")]
    sinks = [None, memoryview(whole), memoryview(part), memoryview(bytearray(8)), memoryview(bytearray(10)),
             memoryview(wrong), memoryview(bytearray(8)), None]
    for _ in range(2):  # (the same pooled connection again: nothing of the last replies left over)
        got = list(read_pipelined(client.connection_pool, [commands[:3], commands[3:]], sinks))
        assert got[0] == small and got[1] == len(big) and got[2] == 1 << 20
        assert bytes(whole) == big and bytes(part) == big[1 << 20 : 2 << 20]
        assert got[3] is None and got[4] == 0
        assert got[5] == 20 and bytes(wrong) == bytes(10)  # (20 bytes for a 10-byte buffer: skipped)
        assert isinstance(got[6], rexc.ResponseError) and "WRONGTYPE" in str(got[6])
        assert got[7] == small
    assert client.get(f"{tag}:small") == small


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_server_that_does_not_answer_is_a_timeout_and_its_connection_is_dropped(silent_listener, protocol):
    """What the tier takes for an unreachable node, within its timeout: the tier's own client does
    not retry (RESP3: the handshake on connecting never gets an answer; RESP2: the GET)."""
    client = make_client(RemoteConfig(url=f"redis://127.0.0.1:{silent_listener}?protocol={protocol}", timeout=0.3,
                                      connect_timeout=0.3), asyncio_client=False)
    t0 = time.monotonic()
    with pytest.raises(rexc.TimeoutError):
        list(read_pipelined(client.connection_pool, [[("GET", "k")]], [memoryview(bytearray(8))]))
    assert time.monotonic() - t0 < 0.3 + 0.5
    assert all(c._sock is None for c in client.connection_pool._available_connections)


def test_chunks_go_ahead_of_their_replies_and_a_reader_that_stops_early_drops_the_connection(redis_node):
    """Each reply comes back as it is read, the next chunk of commands already sent; a caller that
    stops reading leaves replies on the wire: that connection is dropped, the next read is in step."""
    client = redis.Redis.from_url(redis_node.url)
    tag = f"ahead-{time.monotonic_ns()}"
    values = [os.urandom(1 << 20) for _ in range(6)]
    for i, v in enumerate(values):
        client.set(f"{tag}:{i}", v)
    bufs = [bytearray(1 << 20) for _ in values]
    chunks = [[("GET", f"{tag}:{i}") for i in range(j, j + 2)] for j in range(0, 6, 2)]
    replies = read_pipelined(client.connection_pool, chunks, [memoryview(b) for b in bufs])
    assert next(replies) == 1 << 20 and bytes(bufs[0]) == values[0]
    assert bytes(bufs[1]) == bytes(1 << 20)  # (not read yet: nothing but the first reply has landed)
    replies.close()
    assert all(c._sock is None for c in client.connection_pool._available_connections)
    got = list(read_pipelined(client.connection_pool, chunks, [memoryview(b) for b in bufs]))
    assert got == [1 << 20] * 6 and [bytes(b) for b in bufs] == values


def test_a_reader_that_takes_every_reply_and_closes_keeps_its_connection(redis_node):
    """The tier takes exactly its replies and closes the generator there: the connection is in step
    and goes back to the pool open (dropped, every read paid a new connection and its handshake)."""
    client = redis.Redis.from_url(redis_node.url)
    tag = f"keep-{time.monotonic_ns()}"
    client.set(f"{tag}:a", b"x" * 100)
    sock = None
    for _ in range(3):
        replies = read_pipelined(client.connection_pool, [[("GET", f"{tag}:a")]], [None])
        assert next(replies) == b"x" * 100
        replies.close()
        (conn,) = client.connection_pool._available_connections
        assert conn._sock is not None and (sock is None or conn._sock is sock)
        sock = conn._sock
