// Cascade attention's shared-prefix part: in a decode step whose sequences all start with the same
// physical KV blocks (ForwardBatch.common_prefix_blocks; docs/engine.md, "Cascade attention"),
// every sequence's query heads against the prefix's K/V, read once per kv head for all of them
// instead of once per sequence, merged with what attention_decode computed over each sequence's
// own positions. reference/cascade.py is the numpy twin.
//
// A cascade layer is two launches on one stream:
//   attention_decode          (attention_decode.cu, first_position = prefix_len): each sequence's
//                             query over positions prefix_len .. ctx - 1, its normalised output
//                             into `out` and the base-2 log-sum-exp of its scores into `lse`;
//   attention_cascade_prefix  (this file): the prefix partial of every (sequence, query head),
//                             merged with that result in place in `out`.
// prefix_len is one device int (the arena's cascade_prefix_len, uploaded with the step's inputs),
// never a kernel argument: one captured decode graph holds both launches and serves every step of
// its batch size, shared prefix or not. At prefix_len = 0 attention_decode reads whole contexts
// and every block here only waits for it (PDL, below) and leaves.
//
// Rows. Per kv head, the S sequences' GROUP query heads are S * group rows, row r being sequence
// r / group's head kv_head * group + r % group (a sequence's heads adjacent, as q and out hold
// them). They are the MMA's M, as in attention_prefill.cu: a CTA owns BLOCK_Q = 64 rows (4 warps x
// 16) of one kv head and walks every prefix key, tiles of TILE_K keys (32 at head_dim 256: the
// registers of a 256-wide O, as in attention_prefill.cu) through block_tables row 0 (the prefix's
// blocks are the same in every row). No causal mask: a decode query sees the whole prefix; only
// the last tile's keys past prefix_len are masked (and zero-filled, so no stale V reaches P V).
// Grid: (ceil(S * group / BLOCK_Q), num_kv_heads), fixed by the batch size as a graph needs; the
// CTAs of one kv head are neighbours and share its K/V tiles through L2.
//
// Per warp and tile (mma.sync m16n8k16, common.cuh; fragment layouts as attention_prefill.cu's):
//   S = Q K^T     16 rows x TILE_K keys; Q's A fragments in registers, loaded once; K^T's B
//                 fragments ldmatrix.x4 of K rows
//   P = 2^(S scale log2(e) - m)   rounded to bf16 and reused from the accumulators as P V's A
//   O += P V      V's B fragments ldmatrix.x4.trans of V rows; O rescaled by 2^(m_old - m_new)
// Running max m and sum l in fp32 (l of the unrounded P), scores in base 2 throughout, as
// attention_decode.cu keeps them.
//
// Pipeline: STAGES = 2 shared stages, each a K and a V tile ([key][D] rows padded by 8 bf16, so
// one ldmatrix phase's 8 rows fall in distinct banks), filled with cp.async while the other is
// used: tile k + 2 goes out as soon as every warp is done with tile k. Two barriers a tile (the
// tile landed for every thread; every warp done with it).
//
// Merge, in the epilogue (reference/cascade.py's, base 2). Per row the prefix gives (o_p, m_p,
// l_p), m_p in base-2 units; attention_decode gave out_s = o_s / l_s and lse_s = m_s + log2 l_s,
// so its partial relative to any M is (out_s 2^(lse_s - M), 2^(lse_s - M)). With
// M = max(m_p, lse_s):
//   out = (o_p 2^(m_p - M) + out_s 2^(lse_s - M)) / (l_p 2^(m_p - M) + 2^(lse_s - M)).
// An empty suffix (lse_s = -inf, out_s = 0) weighs 2^-inf = 0. Each thread reads and writes
// only its own accumulator elements of `out`. out_s comes as attention_decode stored it, bf16:
// one more rounding than a plain decode output has (tests/test_gpu_cascade.py's tolerance).
//
// PDL. Launched right after attention_decode (programmatic stream serialization). allow_consumer
// first thing, as every kernel here (common.cuh). Before the wait it reads only host uploads
// (prefix_len, block_tables) and issues the copies of its first two K/V tiles: the prefix's rows
// are complete before the step begins and no kernel of the step writes them (the prefix holds
// only full blocks before every sequence's newest token: engine/batch.py's common_prefix_blocks),
// the same argument as attention_decode's early K/V. q (the qkv GEMV's or rope_write_kv's), out
// and lse (attention_decode's) are read after wait_for_producer(); their pointers carry no
// __restrict__, so no read-only load of them is hoisted above it. At prefix_len = 0 every block
// still calls wait_for_producer() before it leaves: the o projection after this kernel waits for
// this grid only, so this grid must not complete before attention_decode has.
//
// block_size must be a power of two (EngineConfig enforces it; the launcher checks it).
#include <math_constants.h>
#include "common.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int BLOCK_Q = WARPS * 16;     // query rows per CTA: 16 per warp, one mma M
constexpr int TILE_K = 64;              // keys per tile
constexpr int WIDE_HEAD_DIM = 256;      // head dims from here on take WIDE_TILE_K keys a tile
constexpr int WIDE_TILE_K = 32;
constexpr int STAGES = 2;               // K/V tiles in shared memory at once
constexpr int ROW_PAD = 8;              // bf16 added to each shared K/V row (16 bytes)

// Keys a tile and dynamic shared bytes at one head_dim (gpu/ops/attention.py: the same rule).
__host__ __device__ constexpr int cascade_tile_keys(int head_dim) {
    return head_dim >= WIDE_HEAD_DIM ? WIDE_TILE_K : TILE_K;
}
__host__ __device__ constexpr int cascade_smem_bytes(int head_dim) {
    return STAGES * 2 * cascade_tile_keys(head_dim) * (head_dim + ROW_PAD) * 2;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ float ex2(float x) {   // 2^x; 2^-inf = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {   // lo -> the lower 16 bits
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t load_u32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

template <int D>
__device__ __forceinline__ void cascade_prefix(
    bf16* out, const float* lse, const bf16* q, int q_row_stride, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ prefix_len_at,
    int num_seqs, int block_size, int num_kv_heads, int group, float scale) {
    constexpr int TK = cascade_tile_keys(D);
    constexpr int ROW = D + ROW_PAD;                     // shared row stride, bf16
    constexpr int CHUNKS = D / 8;                        // 16-byte chunks per K/V row
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;      // tile rows one pass of the CTA copies
    constexpr int LOADS = TK / ROWS_PER_PASS;            // rows each thread copies a tile (K and V)
    constexpr int DK = D / 16;                           // 16-wide chunks of the head dim
    constexpr int NT = TK / 8;                           // n-tiles of S (8 keys each)
    constexpr int NO = D / 8;                            // n-tiles of O (8 dims each)
    constexpr int TILE_BYTES = TK * ROW * 2;
    constexpr int STAGE_BYTES = 2 * TILE_BYTES;          // K, then V
    static_assert(THREADS % CHUNKS == 0 && TK % ROWS_PER_PASS == 0 && NT % 2 == 0, "tile copy shape");
    static_assert(STAGES == 2 && STAGES * STAGE_BYTES == cascade_smem_bytes(D), "launcher's size");
    extern __shared__ __align__(128) unsigned char smem[];
    allow_consumer();

    const int prefix_len = *prefix_len_at;
    if (prefix_len <= 0) {      // no shared prefix this step (PDL in the header: wait, then leave)
        wait_for_producer();
        return;
    }
    const int rows = num_seqs * group, num_q_heads = num_kv_heads * group;
    const int tile_q0 = blockIdx.x * BLOCK_Q, kv_head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int num_tiles = (prefix_len + TK - 1) / TK;
    const int block_shift = __ffs(block_size) - 1;

    // ---- K/V tile copies: this thread's 16-byte chunk of LOADS rows, through row 0's table ------
    const int copy_chunk = threadIdx.x % CHUNKS, copy_row = threadIdx.x / CHUNKS;
    const size_t kv_row = (size_t)num_kv_heads * D;
    const bf16* k_src = k_cache + (size_t)kv_head * D + copy_chunk * 8;
    const bf16* v_src = v_cache + (size_t)kv_head * D + copy_chunk * 8;
    const uint32_t stage0 = smem_addr(smem);
    const uint32_t copy_dst = stage0 + (copy_row * ROW + copy_chunk * 8) * 2;
    int slot[LOADS];            // the cache slot of each row this thread copies; -1 past the prefix
    // Looked up before the copies go out: a table load after an issued cp.async (asm volatile,
    // "memory") would wait for it.
    auto find_slots = [&](int tile) {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int pos = tile * TK + copy_row + i * ROWS_PER_PASS;
            slot[i] = pos < prefix_len ? __ldg(block_tables + (pos >> block_shift)) * block_size + (pos & (block_size - 1)) : -1;
        }
    };
    auto issue = [&](int stage) {
        const uint32_t k_dst = copy_dst + stage * STAGE_BYTES, v_dst = k_dst + TILE_BYTES;
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const bool valid = slot[i] >= 0;
            const size_t src = valid ? (size_t)slot[i] * kv_row : 0;
            const uint32_t row_bytes = i * ROWS_PER_PASS * ROW * 2;
            cp_async16(k_dst + row_bytes, k_src + src, valid ? 16 : 0);
            cp_async16(v_dst + row_bytes, v_src + src, valid ? 16 : 0);
        }
    };
    // Prologue, before the wait (header: PDL): tiles 0 and 1, one commit group each (an empty
    // group where there is no tile 1, so that every tile k is group k).
    find_slots(0);
    issue(0);
    cp_async_commit();
    if (num_tiles > 1) {
        find_slots(1);
        issue(1);
    }
    cp_async_commit();
    wait_for_producer();

    // ---- Q fragments: rows r0 = tile_q0 + 16 warp + g and r1 = r0 + 8 ---------------------------
    const int r0 = tile_q0 + warp * 16 + g, r1 = r0 + 8;
    const bool ok0 = r0 < rows, ok1 = r1 < rows;
    // each row's sequence and query head (row 0's where the row is past the last), and its index
    // (sequence, head) into lse and out
    const int seq0 = ok0 ? r0 / group : 0, head0 = kv_head * group + (ok0 ? r0 % group : 0);
    const int seq1 = ok1 ? r1 / group : 0, head1 = kv_head * group + (ok1 ? r1 % group : 0);
    const int pair0 = seq0 * num_q_heads + head0, pair1 = seq1 * num_q_heads + head1;
    const bool active = tile_q0 + warp * 16 < rows;       // a warp with no row skips the maths
    uint32_t qf[DK][4];
    {
        const bf16* q0 = q + (size_t)seq0 * q_row_stride + head0 * D + 2 * t;
        const bf16* q1 = q + (size_t)seq1 * q_row_stride + head1 * D + 2 * t;
#pragma unroll
        for (int c = 0; c < DK; ++c) {
            qf[c][0] = ok0 ? load_u32(q0 + 16 * c) : 0u;
            qf[c][1] = ok1 ? load_u32(q1 + 16 * c) : 0u;
            qf[c][2] = ok0 ? load_u32(q0 + 16 * c + 8) : 0u;
            qf[c][3] = ok1 ? load_u32(q1 + 16 * c + 8) : 0u;
        }
    }

    // ldmatrix row addresses of this lane within a stage (matrix lane / 8, row lane % 8 of it):
    //   K: (keys +0, d +0) (keys +0, d +8) (keys +8, d +0) (keys +8, d +8) -> b0 b1 of n-tile 2j, then 2j+1
    //   V: (keys +0, d +0) (keys +8, d +0) (keys +0, d +8) (keys +8, d +8), transposed
    //      -> b0 b1 of d-tile 2c, then 2c+1
    const uint32_t k_frag = stage0 + (((lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8) * 2;
    const uint32_t v_frag = stage0 + TILE_BYTES + ((((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8) * 2;

    const float scale_log2 = scale * 1.4426950408889634f;  // e^(x scale) = 2^(x scale_log2)
    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};   // raw scores (times scale_log2 when used)
    float row_sum[2] = {0.0f, 0.0f};    // this lane's share; the 4 lanes of a row add up at the end

    for (int kt = 0; kt < num_tiles; ++kt) {
        const int stage = kt & 1, k0 = kt * TK;
        cp_async_wait<1>();     // groups 0..kt are in (kt + 2 committed)
        __syncthreads();        // ... for every thread
        if (kt + 2 < num_tiles) find_slots(kt + 2);     // in flight under the maths below
        if (active) {
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int c = 0; c < DK; ++c) {
#pragma unroll
                for (int j = 0; j < NT / 2; ++j) {
                    uint32_t b[4];
                    ldmatrix_x4(b, k_frag + stage * STAGE_BYTES + (16 * j * ROW + 16 * c) * 2);
                    mma_bf16(s[2 * j], qf[c][0], qf[c][1], qf[c][2], qf[c][3], b[0], b[1]);
                    mma_bf16(s[2 * j + 1], qf[c][0], qf[c][1], qf[c][2], qf[c][3], b[2], b[3]);
                }
            }
            if (k0 + TK > prefix_len) {          // the last tile: keys past the prefix
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int key = k0 + 8 * n + 2 * t;
                    if (key >= prefix_len) s[n][0] = s[n][2] = -CUDART_INF_F;
                    if (key + 1 >= prefix_len) s[n][1] = s[n][3] = -CUDART_INF_F;
                }
            }
            // online softmax: rows g (r = 0) and g + 8 (r = 1); a row's scores span a lane quad.
            // Key 0 is in the first tile, so every max is finite from there on.
            float alpha[2], offset[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[r];
#pragma unroll
                for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                alpha[r] = ex2((row_max[r] - mx) * scale_log2);      // 0 on the first tile
                offset[r] = mx * scale_log2;
                row_max[r] = mx;
                row_sum[r] *= alpha[r];
            }
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[n][0] *= alpha[0];
                o[n][1] *= alpha[0];
                o[n][2] *= alpha[1];
                o[n][3] *= alpha[1];
            }
            uint32_t p[NT / 2][4];   // P as A fragments, one per 16 keys: n-tile 2j -> a0 a1, 2j+1 -> a2 a3
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float p0 = ex2(fmaf(s[n][0], scale_log2, -offset[0]));
                const float p1 = ex2(fmaf(s[n][1], scale_log2, -offset[0]));
                const float p2 = ex2(fmaf(s[n][2], scale_log2, -offset[1]));
                const float p3 = ex2(fmaf(s[n][3], scale_log2, -offset[1]));
                row_sum[0] += p0 + p1;
                row_sum[1] += p2 + p3;
                p[n / 2][(n & 1) * 2] = pack_bf16(p0, p1);
                p[n / 2][(n & 1) * 2 + 1] = pack_bf16(p2, p3);
            }
#pragma unroll
            for (int j = 0; j < NT / 2; ++j) {
#pragma unroll
                for (int c = 0; c < DK; ++c) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, v_frag + stage * STAGE_BYTES + (16 * j * ROW + 16 * c) * 2);
                    mma_bf16(o[2 * c], p[j][0], p[j][1], p[j][2], p[j][3], b[0], b[1]);
                    mma_bf16(o[2 * c + 1], p[j][0], p[j][1], p[j][2], p[j][3], b[2], b[3]);
                }
            }
        }
        __syncthreads();        // every warp is done with this stage: refill it with tile kt + 2
        if (kt + 2 < num_tiles) issue(stage);
        cp_async_commit();
    }
    cp_async_wait<0>();
    if (!active) return;

    // ---- epilogue: merge with attention_decode's (out_s, lse_s) of each row, in place ------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!(r == 0 ? ok0 : ok1)) continue;
        const int pair = r == 0 ? pair0 : pair1;
        bf16* dst = out + (size_t)pair * D + 2 * t;
        const float lse_s = lse[pair];
        __nv_bfloat162 suffix[NO];      // the row's every load before its first store (out may alias)
#pragma unroll
        for (int n = 0; n < NO; ++n) suffix[n] = *reinterpret_cast<const __nv_bfloat162*>(dst + 8 * n);
        const float m_p = row_max[r] * scale_log2;
        const float m = fmaxf(m_p, lse_s);                    // finite: m_p is
        const float w_p = ex2(m_p - m), w_s = ex2(lse_s - m);
        const float inv = 1.0f / (row_sum[r] * w_p + w_s);    // the sum >= 1: the larger max's own term
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const float2 sx = __bfloat1622float2(suffix[n]);
            *reinterpret_cast<uint32_t*>(dst + 8 * n) =
                pack_bf16((o[n][2 * r] * w_p + sx.x * w_s) * inv, (o[n][2 * r + 1] * w_p + sx.y * w_s) * inv);
        }
    }
}

}  // namespace

// Kernels: attention_cascade_prefix_d{D}, any GQA group (a runtime argument: it only maps rows to
// heads). prefix_len: the device int above; out and lse: attention_decode's, merged into `out`.
#define CASCADE_PREFIX_KERNEL(D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_cascade_prefix_d##D(         \
        bf16* out, const float* lse, const bf16* q, int q_row_stride, const bf16* k_cache,       \
        const bf16* v_cache, const int* block_tables, const int* prefix_len, int num_seqs,       \
        int block_size, int num_kv_heads, int group, float scale) {                              \
        cascade_prefix<D>(out, lse, q, q_row_stride, k_cache, v_cache, block_tables, prefix_len, \
                          num_seqs, block_size, num_kv_heads, group, scale);                     \
    }
CASCADE_PREFIX_KERNEL(64)
CASCADE_PREFIX_KERNEL(128)
CASCADE_PREFIX_KERNEL(256)
