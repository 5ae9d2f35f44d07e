"""Gather/scatter between engine block tensors and pages, for every physical layout vLLM may pick."""

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from lmkv.engine.blockcopy import LayerBlocks, as_bytes_array, block_runs  # noqa: E402

L, B, H, N, C = 3, 10, 2, 16, 8  # layers, blocks, heads, tokens per block, content elements


def views(order: str, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views carved from one backing allocation in physical ``order``
    (vLLM's KVCacheLayout names: letters are the dims from outermost to innermost)."""
    sizes = dict(L=L, B=B, H=H, N=N, C=C)
    backing = torch.randn([sizes[d] for d in order], device=device).to(torch.bfloat16)
    logical = backing.permute([order.index(d) for d in "LBHNC"])
    return [logical[layer] for layer in range(L)]


@pytest.mark.parametrize("order,fast", [("LBHNC", True), ("LBNHC", False), ("LHBNC", False),
                                        ("BLHNC", True), ("BLNHC", False), ("BHLNC", False)])
def test_gather_then_scatter_round_trips_any_layout(order, fast):
    src = [LayerBlocks(t) for t in views(order)]
    nbytes = src[0].nbytes
    assert nbytes == H * N * C * 2
    assert (src[0].rows is not None) == fast  # contiguous blocks are copied as byte rows
    blocks = [7, 2, 5]
    pages = [np.zeros(L * nbytes, np.uint8) for _ in blocks]
    for layer in range(L):
        src[layer].gather(block_runs(blocks, pages), layer * nbytes)
    # the page holds each layer's block in logical [H, N, C] order, layers one after another
    for i, b in enumerate(blocks):
        for layer in range(L):
            got = torch.from_numpy(pages[i][layer * nbytes : (layer + 1) * nbytes]).view(torch.bfloat16)
            assert torch.equal(got.view(H, N, C), src[layer].tensor[b])
    dst = [LayerBlocks(t) for t in views(order)]
    targets = [0, 9, 3]
    for layer in range(L):
        dst[layer].scatter(block_runs(targets, pages), layer * nbytes)
    for b, t in zip(blocks, targets):
        for layer in range(L):
            assert torch.equal(dst[layer].tensor[t], src[layer].tensor[b])


def test_page_buffers_from_numpy_memoryview_and_tensors():
    src = LayerBlocks(views("LBHNC")[0])
    n = src.nbytes
    a, m, t = np.zeros(n, np.uint8), memoryview(bytearray(n)), torch.zeros(n, dtype=torch.uint8)
    src.gather(block_runs([1, 4, 6], [as_bytes_array(a), as_bytes_array(m), as_bytes_array(t)]), 0)
    assert torch.equal(torch.from_numpy(a).view(torch.bfloat16).view(H, N, C), src.tensor[1])
    assert torch.equal(torch.frombuffer(m, dtype=torch.bfloat16).view(H, N, C), src.tensor[4])
    assert torch.equal(t.view(torch.bfloat16).view(H, N, C), src.tensor[6])


def test_runs_merge_consecutive_blocks_over_evenly_spaced_pages_only():
    n = 64
    arena = np.zeros(10 * n, np.uint8)
    slots = [arena[i * n : (i + 1) * n] for i in range(10)]
    # blocks 3,4,5 over slots 0,1,2: one run; 6 over slot 5 breaks the stride and starts a run that
    # 7 over slot 6 continues; 9 is not 8, and its page is a separate allocation
    runs = block_runs([3, 4, 5, 6, 7, 9], [slots[0], slots[1], slots[2], slots[5], slots[6], np.zeros(n, np.uint8)])
    assert [(r.block, r.count, r.stride) for r in runs] == [(3, 3, n), (6, 2, n), (9, 1, 0)]
    assert block_runs([5, 4], [slots[0], slots[1]])[0].count == 1  # blocks not ascending: two runs
    assert [r.count for r in block_runs([1, 2], [slots[0][: n // 2], slots[1]])] == [1, 1]  # sizes differ
    strided = arena[: 2 * n : 2]  # not a plain run of bytes
    assert [(r.block, r.count) for r in block_runs([1, 2, 3], [strided, slots[4], slots[5]])] == [(1, 1), (2, 2)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "BLHNC", "BHLNC"])
def test_runs_over_one_arena_round_trip_any_layout(order):
    """Pages in consecutive slots of one buffer, with a gap between slots (a header's room)."""
    src = [LayerBlocks(t) for t in views(order)]
    nbytes, slot = src[0].nbytes, L * src[0].nbytes + 64
    arena = np.zeros(8 * slot, np.uint8)
    pages = [arena[i * slot : i * slot + L * nbytes] for i in range(8)]
    blocks = [2, 3, 4, 5, 8, 9, 0, 1]
    runs = block_runs(blocks, pages)
    assert [r.count for r in runs] == [4, 2, 2]
    for layer in range(L):
        src[layer].gather(runs, layer * nbytes)
    assert not arena.reshape(8, slot)[:, L * nbytes :].any()  # the gaps are untouched
    for i, b in enumerate(blocks):
        got = torch.from_numpy(pages[i][nbytes : 2 * nbytes]).view(torch.bfloat16).view(H, N, C)
        assert torch.equal(got, src[1].tensor[b])
    dst = [LayerBlocks(t) for t in views(order)]
    for layer in range(L):
        dst[layer].scatter(runs, layer * nbytes)
    for b in blocks:
        for layer in range(L):
            assert torch.equal(dst[layer].tensor[b], src[layer].tensor[b])


def test_bench_copy_quick_json_shape(tmp_path):
    """``lmkv bench copy``: both layouts, GB/s beside a contiguous copy of the same bytes (it checks
    the blocks it scattered back equal those it gathered, and fails otherwise)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lmkv.cli", "bench", "copy", "--quick", "--json", "--dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout)
    assert report["bench"] == "copy"
    for op in ("gather", "scatter"):
        for order in ("LBNHC", "LBHNC"):
            m = report["metrics"][f"{op}.{order}"]
            assert m["unit"] == "GB/s" and m["value"] > 0 and m["baseline"] > 0 and m["baseline_what"]
            assert m["ratio"] == pytest.approx(m["value"] / m["baseline"])
