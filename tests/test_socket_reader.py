"""The buffered socket reader the server, its client and the Redis reads share."""

from __future__ import annotations

import socket
import threading

import pytest

from lmkv.wire.protocol import PeerClosed, ProtocolError, encode, frame, next_frame
from lmkv.wire.socket_reader import SocketReader


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.settimeout(5)
    return a, b


def test_frames_and_bulks_in_any_pieces_come_out_whole_and_in_order():
    a, b = _pair()
    first, second = bytes(range(256)) * 300, b"x" * 10
    wire = frame(4, encode({"n": 1}), len(first)) + first + frame(8, encode({"n": 2}), len(second)) + second
    sender = threading.Thread(target=lambda: [a.sendall(wire[i : i + 7]) for i in range(0, len(wire), 7)])
    sender.start()
    reader = SocketReader(b, ProtocolError, size=16)  # (smaller than one frame: it grows to hold it)
    op, meta, bulk = next_frame(reader, 1 << 20)
    assert (op, meta, bulk) == (4, encode({"n": 1}), len(first))
    assert len(reader._buf) > 16
    got = bytearray(bulk)
    reader.into(memoryview(got))
    assert bytes(got) == first
    op, meta, bulk = next_frame(reader, 1 << 20)
    assert (op, meta) == (8, encode({"n": 2}))
    reader.skip(bulk)
    sender.join()
    a.sendall(b"z")
    assert reader.take(1) == b"z" and len(reader._buf) == 16  # (emptied: back to its first size)
    a.close()
    with pytest.raises(PeerClosed):
        next_frame(reader, 1 << 20)


def test_a_peer_that_closes_mid_frame_is_a_protocol_error_not_a_clean_end():
    a, b = _pair()
    a.sendall(frame(4, encode({"n": 1}), 100)[:10])
    a.close()
    reader = SocketReader(b, ProtocolError)
    with pytest.raises(ProtocolError) as err:
        next_frame(reader, 1 << 20)
    assert not isinstance(err.value, PeerClosed)


def test_lines_and_bodies_share_the_buffer():
    a, b = _pair()
    a.sendall(b"$5\r\nhello\r\n:7\r\n")
    reader = SocketReader(b, ConnectionError, size=4)
    assert reader.line() == b"$5"
    assert reader.take(5) == b"hello"
    assert reader.line() == b""
    assert reader.line() == b":7"
    assert reader.unread == 0
