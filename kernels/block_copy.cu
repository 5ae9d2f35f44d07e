// lmkv block copy kernel: moves engine KV blocks to and from page buffers.
//
// An engine keeps one tensor per layer whose blocks are `block_stride` bytes apart. Within a
// block, the page holds rows of `row_bytes` contiguous bytes in a dense `rows_a` x `rows_b`
// order (the block's logical order, as torch would copy it); in the engine they sit at
// `a * src_a + b * src_b` bytes into the block. A block whose bytes are already in that order
// is one row (rows_a = rows_b = 1); vLLM's per-layer view [blocks, heads, tokens, 2 * head]
// over a token-major (NHD) layout is heads x tokens rows of 2 * head elements. A page holds
// one block of every layer of a cache group, layer `l` at `page_offset + l * layer_stride`.
// One launch copies `n_pages` x `n_layers` (block, layer) pairs: all layers of a step at once,
// or one layer (n_layers = 1) for layerwise transfers. Page buffers may live in device memory
// or in pinned host memory (their device address under unified addressing).
//
// The same source builds with nvcc and hipcc (HIP provides uint4 and the thread builtins).
// The CPU reference it must match is lmkv.blockcopy.LayerBlocks. No headers: NVRTC (how CuPy
// builds it at run time) has no C library headers to include.

extern "C" __global__ void lmkv_block_copy(
    const unsigned long long* __restrict__ layer_ptrs,  // [n_layers] base address of each layer tensor
    const long long* __restrict__ block_ids,            // [n_pages] engine block of each page
    const unsigned long long* __restrict__ page_ptrs,   // [n_pages] base address of each page
    long long block_stride,                             // bytes between consecutive blocks of a layer
    long long rows_a,                                   // a block is rows_a x rows_b rows ...
    long long rows_b,
    long long row_bytes,                                // ... of row_bytes contiguous bytes each,
    long long src_a,                                    // row (a, b) at a * src_a + b * src_b in the engine
    long long src_b,
    long long layer_stride,                             // bytes between layers inside a page
    long long page_offset,                              // where layer_ptrs[0]'s range starts in a page
    int to_pages)                                       // 1: gather blocks into pages; 0: scatter back
{
    const long long page = blockIdx.x;
    const long long layer = blockIdx.y;
    char* blk = reinterpret_cast<char*>(layer_ptrs[layer]) + block_ids[page] * block_stride;
    char* pg = reinterpret_cast<char*>(page_ptrs[page]) + page_offset + layer * layer_stride;
    const long long rows = rows_a * rows_b;
    const unsigned long long aligned =
        reinterpret_cast<unsigned long long>(blk) | reinterpret_cast<unsigned long long>(pg) |
        static_cast<unsigned long long>(row_bytes | src_a | src_b);
    if ((aligned & 15) == 0 && rows == 1) {  // a block whose bytes are in page order: one run of words
        uint4* e = reinterpret_cast<uint4*>(blk);
        uint4* p = reinterpret_cast<uint4*>(pg);
        for (long long w = threadIdx.x; w < row_bytes / 16; w += blockDim.x) {
            if (to_pages) p[w] = e[w]; else e[w] = p[w];
        }
    } else if ((aligned & 15) == 0) {
        const long long words = row_bytes / 16;
        for (long long i = threadIdx.x; i < rows * words; i += blockDim.x) {
            const long long r = i / words, w = i - r * words;
            uint4* e = reinterpret_cast<uint4*>(blk + (r / rows_b) * src_a + (r % rows_b) * src_b) + w;
            uint4* p = reinterpret_cast<uint4*>(pg + r * row_bytes) + w;
            if (to_pages) *p = *e; else *e = *p;
        }
    } else {
        for (long long i = threadIdx.x; i < rows * row_bytes; i += blockDim.x) {
            const long long r = i / row_bytes, c = i - r * row_bytes;
            char* e = blk + (r / rows_b) * src_a + (r % rows_b) * src_b + c;
            char* p = pg + r * row_bytes + c;
            if (to_pages) *p = *e; else *e = *p;
        }
    }
}
