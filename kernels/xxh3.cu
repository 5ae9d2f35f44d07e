// lmkv page digests on the GPU: XXH3-64 (seed 0, the default secret), bit-identical to xxhash's.
//
// A page's checksum covers one digest per (layer, segment) unit (lmkv/page.py). Pages read
// straight into device memory (GPUDirect Storage) are verified where their bytes land, so the
// digests must be computed on the device exactly as the CPU computes them.
//
// The same text builds three ways: as CUDA (nvcc, NVRTC), as HIP (hipcc, hiprtc), and as plain C
// on the host, where the test-suite checks it against the xxhash package on random inputs of
// every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes and long ones, at unaligned
// addresses too). The device kernel runs the very functions that test checks: XXH3's long-input
// loop keeps 8 independent 64-bit accumulators, one per 8-byte lane of a 64-byte stripe, so a
// unit is hashed by 8 threads, one lane each (a lane reads its own word and its neighbour's),
// and lane 0 merges them. Inputs of 240 bytes or less take XXH3's short paths in lane 0.
// Products are 32x32->64 in the loop and a portable 64x64->128 fold elsewhere: no compiler
// intrinsic differs between the host and the device. No headers (NVRTC has none).

typedef unsigned long long lmkv_u64;
typedef unsigned int lmkv_u32;
typedef unsigned char lmkv_u8;

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__CUDACC_RTC__) || defined(__HIPCC_RTC__)
#define LMKV_DEVICE 1
#define LMKV_FN static __device__ inline
#define LMKV_SECRET __constant__
#else
#define LMKV_FN static inline
#define LMKV_SECRET static const
#endif

#define LMKV_P32_1 0x9E3779B1ULL
#define LMKV_P32_2 0x85EBCA77ULL
#define LMKV_P32_3 0xC2B2AE3DULL
#define LMKV_P64_1 0x9E3779B185EBCA87ULL
#define LMKV_P64_2 0xC2B2AE3D27D4EB4FULL
#define LMKV_P64_3 0x165667B19E3779F9ULL
#define LMKV_P64_4 0x85EBCA77C2B2AE63ULL
#define LMKV_P64_5 0x27D4EB2F165667C5ULL
#define LMKV_SECRET_BYTES 192
#define LMKV_STRIPE 64
#define LMKV_BLOCK 1024  // 16 stripes: (secret bytes - stripe) / 8 stripes per scramble

LMKV_SECRET lmkv_u8 lmkv_xxh3_secret[LMKV_SECRET_BYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

// Little-endian loads at any address (one 8-byte load where the address allows it).
LMKV_FN lmkv_u64 lmkv_rd64(const lmkv_u8* p) {
    if ((((lmkv_u64)p) & 7) == 0) return *(const lmkv_u64*)p;
    lmkv_u64 v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

LMKV_FN lmkv_u64 lmkv_rd32(const lmkv_u8* p) {
    return (lmkv_u64)p[0] | ((lmkv_u64)p[1] << 8) | ((lmkv_u64)p[2] << 16) | ((lmkv_u64)p[3] << 24);
}

LMKV_FN lmkv_u64 lmkv_rotl(lmkv_u64 x, int r) { return (x << r) | (x >> (64 - r)); }

LMKV_FN lmkv_u64 lmkv_swap64(lmkv_u64 x) {
    x = ((x << 8) & 0xFF00FF00FF00FF00ULL) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
    x = ((x << 16) & 0xFFFF0000FFFF0000ULL) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
    return (x << 32) | (x >> 32);
}

// The low and high halves of a 128-bit product, folded by XOR.
LMKV_FN lmkv_u64 lmkv_mulfold(lmkv_u64 a, lmkv_u64 b) {
    lmkv_u64 lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    lmkv_u64 hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    lmkv_u64 lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    lmkv_u64 hi_hi = (a >> 32) * (b >> 32);
    lmkv_u64 cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    lmkv_u64 upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    lmkv_u64 lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
}

LMKV_FN lmkv_u64 lmkv_xxh64_avalanche(lmkv_u64 h) {
    h ^= h >> 33;
    h *= LMKV_P64_2;
    h ^= h >> 29;
    h *= LMKV_P64_3;
    return h ^ (h >> 32);
}

LMKV_FN lmkv_u64 lmkv_xxh3_avalanche(lmkv_u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

LMKV_FN lmkv_u64 lmkv_rrmxmx(lmkv_u64 h, lmkv_u64 len) {
    h ^= lmkv_rotl(h, 49) ^ lmkv_rotl(h, 24);
    h *= 0x9FB21C651E98DF25ULL;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ULL;
    return h ^ (h >> 28);
}

LMKV_FN lmkv_u64 lmkv_mix16(const lmkv_u8* p, const lmkv_u8* s) {
    return lmkv_mulfold(lmkv_rd64(p) ^ lmkv_rd64(s), lmkv_rd64(p + 8) ^ lmkv_rd64(s + 8));
}

// 0 to 240 bytes: XXH3's short paths.
LMKV_FN lmkv_u64 lmkv_xxh3_short(const lmkv_u8* p, lmkv_u64 len) {
    const lmkv_u8* s = lmkv_xxh3_secret;
    if (len > 128) {
        lmkv_u64 acc = len * LMKV_P64_1;
        const lmkv_u64 rounds = len / 16;
        for (lmkv_u64 i = 0; i < 8; ++i) acc += lmkv_mix16(p + 16 * i, s + 16 * i);
        lmkv_u64 end = lmkv_mix16(p + len - 16, s + 136 - 17);
        acc = lmkv_xxh3_avalanche(acc);
        for (lmkv_u64 i = 8; i < rounds; ++i) end += lmkv_mix16(p + 16 * i, s + 16 * (i - 8) + 3);
        return lmkv_xxh3_avalanche(acc + end);
    }
    if (len > 16) {
        lmkv_u64 acc = len * LMKV_P64_1;
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += lmkv_mix16(p + 48, s + 96);
                    acc += lmkv_mix16(p + len - 64, s + 112);
                }
                acc += lmkv_mix16(p + 32, s + 64);
                acc += lmkv_mix16(p + len - 48, s + 80);
            }
            acc += lmkv_mix16(p + 16, s + 32);
            acc += lmkv_mix16(p + len - 32, s + 48);
        }
        acc += lmkv_mix16(p, s);
        acc += lmkv_mix16(p + len - 16, s + 16);
        return lmkv_xxh3_avalanche(acc);
    }
    if (len > 8) {
        const lmkv_u64 lo = lmkv_rd64(p) ^ (lmkv_rd64(s + 24) ^ lmkv_rd64(s + 32));
        const lmkv_u64 hi = lmkv_rd64(p + len - 8) ^ (lmkv_rd64(s + 40) ^ lmkv_rd64(s + 48));
        return lmkv_xxh3_avalanche(len + lmkv_swap64(lo) + hi + lmkv_mulfold(lo, hi));
    }
    if (len >= 4) {
        const lmkv_u64 in64 = lmkv_rd32(p + len - 4) + (lmkv_rd32(p) << 32);
        return lmkv_rrmxmx(in64 ^ (lmkv_rd64(s + 8) ^ lmkv_rd64(s + 16)), len);
    }
    if (len > 0) {
        const lmkv_u64 combined = ((lmkv_u64)p[0] << 16) | ((lmkv_u64)p[len >> 1] << 24) | (lmkv_u64)p[len - 1] |
                                  (len << 8);
        return lmkv_xxh64_avalanche(combined ^ (lmkv_rd32(s) ^ lmkv_rd32(s + 4)));
    }
    return lmkv_xxh64_avalanche(lmkv_rd64(s + 56) ^ lmkv_rd64(s + 64));
}

// One 8-byte lane of a stripe into its accumulator: lane i adds its neighbour's word (i ^ 1)
// and the 32x32 product of its own keyed word's halves.
LMKV_FN lmkv_u64 lmkv_stripe(lmkv_u64 acc, const lmkv_u8* in, const lmkv_u8* s, int lane) {
    const lmkv_u64 key = lmkv_rd64(in + 8 * lane) ^ lmkv_rd64(s + 8 * lane);
    return acc + lmkv_rd64(in + 8 * (lane ^ 1)) + (key & 0xFFFFFFFFULL) * (key >> 32);
}

// More than 240 bytes: lane `lane`'s accumulator after every stripe of the input.
LMKV_FN lmkv_u64 lmkv_xxh3_long_lane(const lmkv_u8* p, lmkv_u64 len, int lane) {
    const lmkv_u8* s = lmkv_xxh3_secret;
    const lmkv_u64 init[8] = {LMKV_P32_3, LMKV_P64_1, LMKV_P64_2, LMKV_P64_3,
                              LMKV_P64_4, LMKV_P32_2, LMKV_P64_5, LMKV_P32_1};
    lmkv_u64 acc = init[lane];
    const lmkv_u64 blocks = (len - 1) / LMKV_BLOCK;
    const lmkv_u64 scramble_key = lmkv_rd64(s + LMKV_SECRET_BYTES - LMKV_STRIPE + 8 * lane);
    for (lmkv_u64 b = 0; b < blocks; ++b) {
        const lmkv_u8* blk = p + b * LMKV_BLOCK;
        for (int st = 0; st < 16; ++st) acc = lmkv_stripe(acc, blk + st * LMKV_STRIPE, s + 8 * st, lane);
        acc ^= acc >> 47;
        acc ^= scramble_key;
        acc *= LMKV_P32_1;
    }
    const lmkv_u64 stripes = ((len - 1) - LMKV_BLOCK * blocks) / LMKV_STRIPE;
    for (lmkv_u64 st = 0; st < stripes; ++st)
        acc = lmkv_stripe(acc, p + blocks * LMKV_BLOCK + st * LMKV_STRIPE, s + 8 * st, lane);
    return lmkv_stripe(acc, p + len - LMKV_STRIPE, s + LMKV_SECRET_BYTES - LMKV_STRIPE - 7, lane);
}

LMKV_FN lmkv_u64 lmkv_xxh3_merge(const lmkv_u64* acc, lmkv_u64 len) {
    const lmkv_u8* s = lmkv_xxh3_secret + 11;
    lmkv_u64 h = len * LMKV_P64_1;
    for (int i = 0; i < 4; ++i)
        h += lmkv_mulfold(acc[2 * i] ^ lmkv_rd64(s + 16 * i), acc[2 * i + 1] ^ lmkv_rd64(s + 16 * i + 8));
    return lmkv_xxh3_avalanche(h);
}

#ifdef LMKV_DEVICE
// Digests of n byte ranges (device or pinned host memory): unit u at ptrs[u], lens[u] bytes.
// 64 threads a block: 8 units, 8 lanes each.
extern "C" __global__ void lmkv_xxh3_64(const lmkv_u64* __restrict__ ptrs, const long long* __restrict__ lens,
                                        lmkv_u64* __restrict__ out, long long n) {
    __shared__ lmkv_u64 accs[64];
    const long long unit = (long long)blockIdx.x * 8 + threadIdx.x / 8;
    const int lane = threadIdx.x % 8;
    const bool mine = unit < n;
    const lmkv_u8* p = mine ? (const lmkv_u8*)ptrs[unit] : 0;
    const lmkv_u64 len = mine ? (lmkv_u64)lens[unit] : 0;
    if (mine && len > 240) accs[threadIdx.x] = lmkv_xxh3_long_lane(p, len, lane);
    __syncthreads();
    if (mine && lane == 0) out[unit] = len > 240 ? lmkv_xxh3_merge(accs + threadIdx.x, len) : lmkv_xxh3_short(p, len);
}
#else
// The host build, for the test-suite: the same functions, one lane after another.
lmkv_u64 lmkv_xxh3_64_host(const lmkv_u8* p, lmkv_u64 len) {
    if (len <= 240) return lmkv_xxh3_short(p, len);
    lmkv_u64 acc[8];
    for (int lane = 0; lane < 8; ++lane) acc[lane] = lmkv_xxh3_long_lane(p, len, lane);
    return lmkv_xxh3_merge(acc, len);
}
#endif
