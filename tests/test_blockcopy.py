"""Gather/scatter between engine block tensors and pages, for every physical layout vLLM may pick."""

import pytest

torch = pytest.importorskip("torch")

from lmkv.blockcopy import as_uint8_tensor, block_nbytes, gather_layer, scatter_layer  # noqa: E402

L, B, H, N, C = 3, 10, 2, 16, 8  # layers, blocks, heads, tokens per block, content elements


def views(order: str) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views carved from one backing allocation in physical ``order``
    (vLLM's KVCacheLayout names: letters are the dims from outermost to innermost)."""
    sizes = dict(L=L, B=B, H=H, N=N, C=C)
    backing = torch.randn([sizes[d] for d in order]).to(torch.bfloat16)
    logical = backing.permute([order.index(d) for d in "LBHNC"])
    return [logical[layer] for layer in range(L)]


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_gather_then_scatter_round_trips_any_layout(order):
    src = views(order)
    nbytes = block_nbytes(src[0])
    assert nbytes == H * N * C * 2
    blocks = [7, 2, 5]
    pages = [as_uint8_tensor(torch.zeros(L * nbytes, dtype=torch.uint8)) for _ in blocks]
    for layer in range(L):
        gather_layer(src[layer], blocks, pages, layer * nbytes)
    # the page holds each layer's block in logical [H, N, C] order, layers one after another
    for i, b in enumerate(blocks):
        for layer in range(L):
            got = pages[i][layer * nbytes : (layer + 1) * nbytes].view(torch.bfloat16).view(H, N, C)
            assert torch.equal(got, src[layer][b])
    dst = views(order)
    targets = [0, 9, 3]
    for layer in range(L):
        scatter_layer(dst[layer], targets, pages, layer * nbytes)
    for i, (b, t) in enumerate(zip(blocks, targets)):
        for layer in range(L):
            assert torch.equal(dst[layer][t], src[layer][b])


def test_page_buffers_from_numpy_and_memoryview():
    import numpy as np

    src = views("LBHNC")[0]
    n = block_nbytes(src)
    a = np.zeros(n, np.uint8)
    m = memoryview(bytearray(n))
    gather_layer(src, [1, 4], [as_uint8_tensor(a), as_uint8_tensor(m)], 0)
    assert torch.equal(torch.from_numpy(a).view(torch.bfloat16).view(H, N, C), src[1])
    assert torch.equal(torch.frombuffer(m, dtype=torch.bfloat16).view(H, N, C), src[4])
