"""The lean pair ``lmkv bench scale`` measures beside ``lmkv serve`` (Python's floor for one-page
GETs in lmkv's wire format): its client reads and verifies every page its server sends."""

from __future__ import annotations

import time

import pytest

from lmkv.benchmarks import scale
from lmkv.benchmarks.scale import _lean_get_loop, _lean_server
from lmkv.benchmarks.tiers import random_keys
from lmkv.page import ChecksumError


def test_the_lean_pair_moves_verified_pages():
    keys = random_keys(4)
    with _lean_server(64 << 10, keys) as port:
        assert _lean_get_loop(int(port), 64 << 10, keys, time.time() + 0.3) > 10


def test_the_lean_client_checks_the_bytes_it_reads(monkeypatch):
    """A page whose bytes differ from its header's digests fails the lean client, as in lmkv."""
    keys = random_keys(2)
    with _lean_server(64 << 10, keys) as port:
        real = scale.verify_payload

        def flipped(header, layout, out):
            out[7] ^= 1  # (a byte changed on the way)
            real(header, layout, out)

        monkeypatch.setattr(scale, "verify_payload", flipped)
        with pytest.raises(ChecksumError):
            _lean_get_loop(int(port), 64 << 10, keys, time.time() + 0.3)
