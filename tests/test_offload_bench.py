"""``lmkv bench offload``'s bound of what judging a block by its request can reach."""

from __future__ import annotations

from lmkv.benchmarks.offload import _request_bound
from lmkv.offload.traces import TraceRequest

BLOCK = 4


def _req(rid: str, *blocks: int) -> TraceRequest:
    """A request whose prompt is these blocks of content (each ``BLOCK`` tokens of its number)."""
    return TraceRequest(rid, 0, rid, [b for b in blocks for _ in range(BLOCK)], [1, 2])


def test_groups_that_tell_reuse_apart_are_copied_alone():
    """Documents (two blocks) each asked again; one-shot prompts (four blocks) never: a policy that knew
    the groups' rates copies exactly the blocks asked for again."""
    docs = [_req(f"d{i}", 10 * i, 10 * i + 1) for i in range(4)]
    again = [_req(f"q{i}", 10 * i, 10 * i + 1, 1000 + i) for i in range(4)]
    stream = [_req(f"s{i}", *range(500 + 4 * i, 504 + 4 * i)) for i in range(4)]
    assert _request_bound(docs + stream + again, BLOCK) == (8, 8)


def test_requests_that_look_alike_are_copied_alike():
    """Four first turns alike, two of them continued: whatever a request shows, keeping the reused blocks
    means copying all four."""
    first = [_req(f"t{i}", 10 * i, 10 * i + 1) for i in range(4)]
    second = [_req(f"u{i}", 10 * i, 10 * i + 1, 1000 + i) for i in range(2)]
    assert _request_bound(first + second, BLOCK) == (4, 8)
