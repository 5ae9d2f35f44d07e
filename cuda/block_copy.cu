// lmkv block copy kernel: moves engine KV blocks to and from page buffers.
//
// An engine keeps one tensor per layer whose blocks are `block_stride` bytes apart; one
// block of one layer is `block_bytes` contiguous bytes (vLLM's HND/NHD per-layer views,
// block-outermost layouts). A page holds one block of every layer of a cache group, layer
// `l` at `page_offset + l * layer_stride`. One launch copies `n_pages` x `n_layers`
// (block, layer) pairs: all layers of a step at once, or one layer (n_layers = 1) for
// layerwise transfers. Page buffers may live in device memory or in pinned, mapped host
// memory (their device address under unified addressing).
//
// The same source builds with nvcc and hipcc (HIP provides uint4 and the thread builtins).
// The CPU reference it must match is lmkv.blockcopy.LayerBlocks. No headers: NVRTC (how CuPy
// builds it at run time) has no C library headers to include.

extern "C" __global__ void lmkv_block_copy(
    const unsigned long long* __restrict__ layer_ptrs,  // [n_layers] base address of each layer tensor
    const long long* __restrict__ block_ids,            // [n_pages] engine block of each page
    const unsigned long long* __restrict__ page_ptrs,   // [n_pages] base address of each page
    long long block_stride,                             // bytes between consecutive blocks of a layer
    long long block_bytes,                              // bytes of one block of one layer
    long long layer_stride,                             // bytes between layers inside a page
    long long page_offset,                              // where layer_ptrs[0]'s range starts in a page
    int to_pages)                                       // 1: gather blocks into pages; 0: scatter back
{
    const long long page = blockIdx.x;
    const long long layer = blockIdx.y;
    char* blk = reinterpret_cast<char*>(layer_ptrs[layer]) + block_ids[page] * block_stride;
    char* pg = reinterpret_cast<char*>(page_ptrs[page]) + page_offset + layer * layer_stride;
    const char* src = to_pages ? blk : pg;
    char* dst = to_pages ? pg : blk;
    if (((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst) | block_bytes) & 15) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (long long i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) {
            d[i] = s[i];
        }
    } else {
        for (long long i = threadIdx.x; i < block_bytes; i += blockDim.x) {
            dst[i] = src[i];
        }
    }
}
