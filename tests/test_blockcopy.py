"""Gather/scatter between engine block tensors and pages, for every physical layout vLLM may pick."""

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from lmkv.blockcopy import LayerBlocks, as_bytes_array  # noqa: E402

L, B, H, N, C = 3, 10, 2, 16, 8  # layers, blocks, heads, tokens per block, content elements


def views(order: str) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views carved from one backing allocation in physical ``order``
    (vLLM's KVCacheLayout names: letters are the dims from outermost to innermost)."""
    sizes = dict(L=L, B=B, H=H, N=N, C=C)
    backing = torch.randn([sizes[d] for d in order]).to(torch.bfloat16)
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
        src[layer].gather(blocks, pages, layer * nbytes)
    # the page holds each layer's block in logical [H, N, C] order, layers one after another
    for i, b in enumerate(blocks):
        for layer in range(L):
            got = torch.from_numpy(pages[i][layer * nbytes : (layer + 1) * nbytes]).view(torch.bfloat16)
            assert torch.equal(got.view(H, N, C), src[layer].tensor[b])
    dst = [LayerBlocks(t) for t in views(order)]
    targets = [0, 9, 3]
    for layer in range(L):
        dst[layer].scatter(targets, pages, layer * nbytes)
    for b, t in zip(blocks, targets):
        for layer in range(L):
            assert torch.equal(dst[layer].tensor[t], src[layer].tensor[b])


def test_page_buffers_from_numpy_memoryview_and_tensors():
    src = LayerBlocks(views("LBHNC")[0])
    n = src.nbytes
    a, m, t = np.zeros(n, np.uint8), memoryview(bytearray(n)), torch.zeros(n, dtype=torch.uint8)
    src.gather([1, 4, 6], [as_bytes_array(a), as_bytes_array(m), as_bytes_array(t)], 0)
    assert torch.equal(torch.from_numpy(a).view(torch.bfloat16).view(H, N, C), src.tensor[1])
    assert torch.equal(torch.frombuffer(m, dtype=torch.bfloat16).view(H, N, C), src.tensor[4])
    assert torch.equal(t.view(torch.bfloat16).view(H, N, C), src.tensor[6])
