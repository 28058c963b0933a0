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
// and this kernel does nothing (PDL, below).
//
// Rows. Per kv head, the S sequences' GROUP query heads are S * group rows, row r being sequence
// r / group's head kv_head * group + r % group (a sequence's heads adjacent, as q and out hold
// them). They are the MMA's M, as in attention_prefill.cu: a CTA owns BLOCK_Q = 64 rows (4 warps x
// 16) of one kv head, a "q tile", and walks its split of the prefix's keys in tiles of TILE_K keys
// (32 at head_dim 256: the registers of a 256-wide O, as in attention_prefill.cu) through
// block_tables row 0 (the prefix's blocks are the same in every row). No causal mask: a decode
// query sees the whole prefix; only the prefix's last tile has keys past prefix_len, masked (and
// zero-filled, so no stale V reaches P V).
//
// Splits. Grid: (q tiles = ceil(S * group / BLOCK_Q), num_kv_heads, splits). One CTA walking the
// whole prefix is a serial chain of prefix_len / TILE_K tiles, and the grid of one CTA per q tile
// is only 32 CTAs at S = 64 on the Llama-1B shape (8 kv heads, group 4), 128 at S = 256: it ran
// 29.5 us a layer at S = 256 for 2.1 GFLOP (H100, 2026-12-07). So the prefix's tiles are cut into
// contiguous splits, one CTA each. The launcher fixes the grid's split count per batch size, as a
// graph needs (ops/attention.py's cascade_splits: enough CTAs to fill the GPU about twice,
// ceil(2 SMs / (q tiles * kv heads)), at most MAX_SPLITS); the kernel cuts the prefix it finds on
// the device: per_split = max(MIN_SPLIT_KEYS / TILE_K, ceil(tiles / gridDim.z)) tiles a split and
// num_splits = ceil(tiles / per_split) splits, so no split is empty; the CTAs of the splits past
// those leave at once (as attention_decode's surplus splits do). MIN_SPLIT_KEYS = 128: a split's
// partial (64 rows x D fp32), stored once and read back once, is then at most half the bytes of
// the K/V it reads. The split count depends only on the grid and prefix_len, never on timing. (At
// head_dim 128 and 256 two CTAs fit an SM, three at 64, so a grid just past 2 x SMs CTAs runs a
// short second wave there; whether to round the count down for them is for a timing to say.)
//
// Per warp and tile (mma.sync m16n8k16, common.cuh; fragment layouts as attention_prefill.cu's):
//   S = Q K^T     16 rows x TILE_K keys; Q's A fragments in registers, loaded once; K^T's B
//                 fragments ldmatrix.x4 of K rows
//   P = 2^(S scale log2(e) - m)   rounded to bf16 and reused from the accumulators as P V's A
//   O += P V      V's B fragments ldmatrix.x4.trans of V rows; O rescaled by 2^(m_old - m_new)
// Running max m and sum l in fp32 (l of the unrounded P), scores in base 2 throughout, as
// attention_decode.cu keeps them.
//
// Pipeline: STAGES = 3 shared stages, each a K and a V tile ([key][D] rows padded by 8 bf16, so
// one ldmatrix phase's 8 rows fall in distinct banks), filled with cp.async: at tile k, once every
// thread has tile k (one barrier a tile, which also says every warp is done with tile k - 1), tile
// k + 2 goes into tile k - 1's stage, so two tiles are in flight under each tile's maths. Why
// three: occupancy is set by registers, not shared memory, at every head dim (d64: 135 registers,
// 3 CTAs an SM, 3 x 55 KB; d128: 175, 2 CTAs, 2 x 104 KB; d256: 255, 2 CTAs, 2 x 101 KB), so the
// third stage costs no CTA, and it keeps 2 x 16 KB a CTA in flight where the prefix's re-reads
// run at L2 bandwidth (batch 256, below), with one barrier a tile instead of two. More rows per
// CTA (8 warps, 128 rows) would halve the K/V re-reads from L2 (the batch-256 floor below), but
// at 135 registers only one 8-warp CTA fits an SM, and the CTAs a prefix split can give halve at
// every batch size; it is left for a measured step.
//
// Merge. Per row the prefix gives (o_p, m_p, l_p), m_p in base-2 units; attention_decode gave
// out_s = o_s / l_s and lse_s = m_s + log2 l_s, so its partial relative to any M is
// (out_s 2^(lse_s - M), 2^(lse_s - M)) (reference/cascade.py's merge, base 2). With M the max of
// every part's m:
//   out = (sum_i o_i 2^(m_i - M) + out_s 2^(lse_s - M)) / (sum_i l_i 2^(m_i - M) + 2^(lse_s - M)).
// An empty suffix (lse_s = -inf, out_s = 0) weighs 2^-inf = 0. out_s comes as attention_decode
// stored it, bf16: one more rounding than a plain decode output has (tests/test_gpu_cascade.py).
//   * One split (num_splits = 1, whatever the grid): the epilogue merges its registers with
//     (out_s, lse_s) directly, each thread its own accumulator elements of `out`; no workspace.
//   * Several: each split stores its partial to the workspace (arena: cascade_partial_o, fp32
//     [tile][split][BLOCK_Q][D], tile = kv_head * q tiles + q tile, and cascade_partial_ml, the
//     rows' (m, l)), then counts itself done on split_counters[tile] (fence, barrier, one atomic,
//     as attention_decode's splits do); the CTA that counts last resets the counter (the arena
//     starts it at zero) and merges: per row the weights 2^(m_i - M) / den into shared memory,
//     then each thread sums MERGE_QUADS 4-dim quads over the splits in split order, the suffix
//     last, with 16 float4 loads in flight. The sums are the same whichever split merges, so the
//     output is too. Partials are read through L2 (__ldcg): L1 is not coherent across SMs.
//
// PDL. Launched right after attention_decode (programmatic stream serialization). allow_consumer
// first thing, as every kernel here (common.cuh). Before the wait it reads only host uploads
// (prefix_len, block_tables) and issues the copies of its split's first two K/V tiles: the
// prefix's rows are complete before the step begins and no kernel of the step writes them (the
// prefix holds only full blocks before every sequence's newest token: engine/batch.py's
// common_prefix_blocks), the same argument as attention_decode's early K/V. q (the qkv GEMV's or
// rope_write_kv's), out and lse (attention_decode's) and the workspace (attention_decode's own
// partials share its bytes: arena.py) are touched after wait_for_producer(); q, out and lse carry
// no __restrict__, so no read-only load of them is hoisted above it. The o projection after this
// kernel waits for this grid only, so this grid must not complete before attention_decode has:
// with a prefix, every tile's split 0 waits (surplus splits may leave at once); at prefix_len = 0
// block (0, 0, 0) waits and every other leaves at once.
//
// Expected time (a model for the next GPU run to check; Llama-1B shapes: head_dim 64, 32 q heads,
// 8 kv heads; prefix 1,024 = 16 tiles, suffix ~276; H100 SXM, 132 SMs). Rates: L2 ~5 TB/s
// (main's shared-block decode moved 512 MB of prefix re-reads and 145 MB from DRAM in 102.6 us at
// batch 256), mma.sync ~400 TFLOP/s, ex2 16 a clock an SM. Prefix work: S * 32 rows x 1,024 keys
// x 64 dims, 2 GEMMs: 8.4 MFLOP a sequence.
//   batch 256: 1,024 rows a kv head, 16 q tiles x 8 = 128 tiles; splits ceil(264 / 128) = 3 of
//     6, 6, 4 tiles: 384 CTAs, one wave at 3 an SM. L2 traffic: K/V 128 x 256 KB = 32 MB, q 3 MB,
//     partials 6.3 MB stored and 6.3 MB read, out/lse 2 MB: ~50 MB, 10 us at 5 TB/s; tensor 2.15
//     GFLOP, 5.4 us; ex2 8.4 M, 2.3 us, both under the L2 time. Predicted ~11 us a layer (one CTA
//     a q tile: 29.5 measured), so attention ~65 us a layer with the suffix's 54 (main, shared
//     blocks: 102.6), the decode graph ~3.019 - 16 x 0.0185 = ~2.72 ms a step (main, shared: 3.278).
//   batch 64: 256 rows a kv head, 4 x 8 = 32 tiles; splits ceil(264 / 32) = 9, 2 tiles each, 8
//     used: 256 CTAs. ~19 MB of L2 traffic and 0.54 GFLOP are under 4 us; the chain is latency:
//     wait + q (~1 us), 2 tiles (~0.7 us, their K/V copied before the wait), partial store,
//     fence and atomic (~1 us), the last CTA's weights (~0.5 us) and 8 partials of 16.5 KB in
//     4 rounds of 32 KB (~1.7 us). Predicted ~5 us a layer (one CTA a q tile walks all 16 tiles
//     serially at any batch: ~29.5 us, as at 256), the decode graph ~2.035 - 16 x 0.0245 = ~1.64
//     ms a step (main, shared: 1.778).
//   prefix 0: the graph still holds the launch, one block of which waits; one CTA a q tile cost
//     ~1.7 us a layer over main (2.292 vs 2.264 ms a step at batch 64, 5.194 vs 5.166 at 256), and
//     the splits' extra CTAs leave at once, so the same is expected.
// When cascade pays (engine/batch.py's rule, kept as vLLM's: >= 8 sequences, >= 256 shared
// tokens): plain decode re-reads the prefix S x P x 2 KB a layer (these shapes) at ~5 TB/s, the
// prefix kernel costs a ~4-5 us latency floor; the model's break-even is S x P ~ 11,000
// (S 64: P ~ 170, already below the 256-token floor; S 8: P ~ 1,400), so small batches with short
// prefixes may lose a few us a layer. The rule changes only on timings (decode_profile.py
// --batch 8 16 32 --shared-prefix 256 / 1024).
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
constexpr int STAGES = 3;               // K/V tiles in shared memory at once (two in flight)
constexpr int ROW_PAD = 8;              // bf16 added to each shared K/V row (16 bytes)
constexpr int MAX_SPLITS = 16;          // prefix splits a (q tile, kv head) may use; the arena's
                                        // workspace holds this many partials of each
constexpr int MIN_SPLIT_KEYS = 128;     // keys a split covers at least (header: splits)
constexpr int MERGE_QUADS = 8;          // output quads (4 dims) a merging thread sums at once

// Keys a tile and dynamic shared bytes at one head_dim (gpu/ops/attention.py: the same rule).
__host__ __device__ constexpr int cascade_tile_keys(int head_dim) {
    return head_dim >= WIDE_HEAD_DIM ? WIDE_TILE_K : TILE_K;
}
__host__ __device__ constexpr int cascade_smem_bytes(int head_dim) {
    return STAGES * 2 * cascade_tile_keys(head_dim) * (head_dim + ROW_PAD) * 2;
}


// The (sequence, query head) index of tile row `row` of kv head kv_head: into q's heads, lse, out.
__device__ __forceinline__ int row_pair(int row, int kv_head, int group, int num_q_heads) {
    return (row / group) * num_q_heads + kv_head * group + row % group;
}

template <int D>
__device__ __forceinline__ void cascade_prefix(
    bf16* out, const float* lse, float* __restrict__ partial_o, float* __restrict__ partial_ml,
    int* __restrict__ split_counters, const bf16* q, int q_row_stride, const bf16* __restrict__ k_cache,
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
    constexpr int MIN_SPLIT_TILES = MIN_SPLIT_KEYS / TK;
    static_assert(THREADS % CHUNKS == 0 && TK % ROWS_PER_PASS == 0 && NT % 2 == 0, "tile copy shape");
    static_assert(STAGES == 3 && STAGES * STAGE_BYTES == cascade_smem_bytes(D), "launcher's size");
    static_assert(MIN_SPLIT_KEYS % TK == 0, "splits of whole tiles");
    extern __shared__ __align__(128) unsigned char smem[];
    allow_consumer();

    // ---- this block's split of the prefix's tiles (header: splits) -------------------------------
    const int prefix_len = *prefix_len_at, split = blockIdx.z;
    if (prefix_len <= 0) {      // no shared prefix this step (header: PDL): one block waits, the rest leave
        if (blockIdx.x == 0 && blockIdx.y == 0 && split == 0) wait_for_producer();
        return;
    }
    const int num_tiles = (prefix_len + TK - 1) / TK;
    const int per_split = max(MIN_SPLIT_TILES, (num_tiles + (int)gridDim.z - 1) / (int)gridDim.z);
    const int num_splits = (num_tiles + per_split - 1) / per_split;      // none of them empty
    if (split >= num_splits) return;     // a split past the prefix (split 0 of this tile waits)
    const int first_tile = split * per_split, tiles = min(per_split, num_tiles - first_tile);

    const int rows = num_seqs * group, num_q_heads = num_kv_heads * group;
    const int tile_q0 = blockIdx.x * BLOCK_Q, kv_head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int block_shift = __ffs(block_size) - 1;

    // ---- K/V tile copies: this thread's 16-byte chunk of LOADS rows, through row 0's table ------
    const int copy_chunk = threadIdx.x % CHUNKS, copy_row = threadIdx.x / CHUNKS;
    const size_t kv_row = (size_t)num_kv_heads * D;
    const bf16* k_src = k_cache + (size_t)kv_head * D + copy_chunk * 8;
    const bf16* v_src = v_cache + (size_t)kv_head * D + copy_chunk * 8;
    const uint32_t stage0 = smem_addr(smem);
    const uint32_t copy_dst = stage0 + (copy_row * ROW + copy_chunk * 8) * 2;
    int slot[LOADS];            // the cache slot of each row this thread copies; -1 past the prefix
    // split tile i's slots, looked up one tile ahead of its copies (the table load's latency
    // then hides under a tile's maths)
    auto find_slots = [&](int i) {
#pragma unroll
        for (int j = 0; j < LOADS; ++j) {
            const int pos = (first_tile + i) * TK + copy_row + j * ROWS_PER_PASS;
            slot[j] = pos < prefix_len ? __ldg(block_tables + (pos >> block_shift)) * block_size + (pos & (block_size - 1)) : -1;
        }
    };
    auto issue = [&](int stage) {
        const uint32_t k_dst = copy_dst + stage * STAGE_BYTES, v_dst = k_dst + TILE_BYTES;
#pragma unroll
        for (int j = 0; j < LOADS; ++j) {
            const bool valid = slot[j] >= 0;
            const size_t src = valid ? (size_t)slot[j] * kv_row : 0;
            const uint32_t row_bytes = j * ROWS_PER_PASS * ROW * 2;
            cp_async16(k_dst + row_bytes, k_src + src, valid ? 16 : 0);
            cp_async16(v_dst + row_bytes, v_src + src, valid ? 16 : 0);
        }
    };
    // Prologue, before the wait (header: PDL): split tiles 0 and 1 into stages 0 and 1, one commit
    // group each (an empty one where there is no tile 1, so that tile i is always group i), and
    // tile 2's slots.
    find_slots(0);
    issue(0);
    cp_async_commit();
    if (tiles > 1) {
        find_slots(1);
        issue(1);
    }
    cp_async_commit();
    if (tiles > 2) find_slots(2);
    wait_for_producer();

    // ---- Q fragments: rows r0 = tile_q0 + 16 warp + g and r1 = r0 + 8 ---------------------------
    const int r0 = tile_q0 + warp * 16 + g, r1 = r0 + 8;
    const bool ok0 = r0 < rows, ok1 = r1 < rows;
    // each row's (sequence, query head) index into q's heads, lse and out (row 0's where the row
    // is past the last)
    const int pair0 = row_pair(ok0 ? r0 : 0, kv_head, group, num_q_heads);
    const int pair1 = row_pair(ok1 ? r1 : 0, kv_head, group, num_q_heads);
    const bool active = tile_q0 + warp * 16 < rows;       // a warp with no row skips the maths
    uint32_t qf[DK][4];
    {
        const bf16* q0 = q + (size_t)(pair0 / num_q_heads) * q_row_stride + (pair0 % num_q_heads) * D + 2 * t;
        const bf16* q1 = q + (size_t)(pair1 / num_q_heads) * q_row_stride + (pair1 % num_q_heads) * D + 2 * t;
        load_q_fragments(qf, q0, q1, ok0, ok1);
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

    int stage = 0, fill = 2;            // the stage of tile kt, and the one tile kt + 2 goes to
    for (int kt = 0; kt < tiles; ++kt) {
        const int k0 = (first_tile + kt) * TK;
        cp_async_wait<1>();     // groups 0..kt are in (kt + 2 committed)
        __syncthreads();        // ... for every thread; and every warp is done with tile kt - 1
        if (kt + 2 < tiles) issue(fill);                // into tile kt - 1's stage
        cp_async_commit();
        if (kt + 3 < tiles) find_slots(kt + 3);         // in flight under the maths below
        if (active) {
            float s[NT][4];
            score_tile<NT, DK, ROW>(s, qf, k_frag + stage * STAGE_BYTES);
            if (k0 + TK > prefix_len) {          // the prefix's last tile: keys past its end
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int key = k0 + 8 * n + 2 * t;
                    if (key >= prefix_len) s[n][0] = s[n][2] = -CUDART_INF_F;
                    if (key + 1 >= prefix_len) s[n][1] = s[n][3] = -CUDART_INF_F;
                }
            }
            // online softmax: rows g (r = 0) and g + 8 (r = 1); a row's scores span a lane quad.
            // A tile's first key is below prefix_len, so every max is finite from the first tile on.
            float alpha[2], offset[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[r];
#pragma unroll
                for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                alpha[r] = fast_exp2((row_max[r] - mx) * scale_log2);      // 0 on the first tile
                offset[r] = mx * scale_log2;
                row_max[r] = mx;
                row_sum[r] *= alpha[r];
            }
            rescale_rows(o, alpha);
            uint32_t p[NT / 2][4];   // P as A fragments for P @ V (common.cuh's softmax_to_fragments)
            softmax_to_fragments(s, scale_log2, offset, row_sum, p);
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
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        fill = fill + 1 == STAGES ? 0 : fill + 1;
    }
    cp_async_wait<0>();         // only empty groups are left; none lands after this
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    const float m_p[2] = {row_max[0] * scale_log2, row_max[1] * scale_log2};   // base-2 units

    if (num_splits == 1) {
        // ---- one split: merge with attention_decode's (out_s, lse_s) of each row, in place ------
        if (!active) return;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (!(r == 0 ? ok0 : ok1)) continue;
            const int pair = r == 0 ? pair0 : pair1;
            bf16* dst = out + (size_t)pair * D + 2 * t;
            const float lse_s = lse[pair];
            __nv_bfloat162 suffix[NO];      // the row's every load before its first store (out may alias)
#pragma unroll
            for (int n = 0; n < NO; ++n) suffix[n] = *reinterpret_cast<const __nv_bfloat162*>(dst + 8 * n);
            const float m = fmaxf(m_p[r], lse_s);                 // finite: m_p is
            const float w_p = fast_exp2(m_p[r] - m), w_s = fast_exp2(lse_s - m);
            const float inv = 1.0f / (row_sum[r] * w_p + w_s);    // the sum >= 1: the larger max's own term
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                const float2 sx = __bfloat1622float2(suffix[n]);
                *reinterpret_cast<uint32_t*>(dst + 8 * n) =
                    pack_bf16x2((o[n][2 * r] * w_p + sx.x * w_s) * inv, (o[n][2 * r + 1] * w_p + sx.y * w_s) * inv);
            }
        }
        return;
    }

    // ---- several splits: this one's partial into the workspace (header: workspace) -------------
    const size_t tile_index = (size_t)blockIdx.y * gridDim.x + blockIdx.x;    // (kv head, q tile)
    float* const tile_o = partial_o + tile_index * gridDim.z * BLOCK_Q * D;  // [split][BLOCK_Q][D]
    float2* const tile_ml = reinterpret_cast<float2*>(partial_ml) + tile_index * gridDim.z * BLOCK_Q;
    if (active) {
        const int row0 = warp * 16 + g;
        float* my_o = tile_o + ((size_t)split * BLOCK_Q + row0) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            __stcg(reinterpret_cast<float2*>(my_o + 8 * n), make_float2(o[n][0], o[n][1]));
            __stcg(reinterpret_cast<float2*>(my_o + 8 * D + 8 * n), make_float2(o[n][2], o[n][3]));
        }
        if (t == 0) {
            __stcg(tile_ml + split * BLOCK_Q + row0, make_float2(m_p[0], row_sum[0]));
            __stcg(tile_ml + split * BLOCK_Q + row0 + 8, make_float2(m_p[1], row_sum[1]));
        }
    }
    // Count this split done; the last of the tile's splits merges them all (decode's pattern:
    // attention_decode.cu).
    __shared__ bool is_last;
    __threadfence();            // the partial is visible device-wide before it is counted
    __syncthreads();
    int* counter = split_counters + tile_index;
    if (threadIdx.x == 0) {
        is_last = atomicAdd(counter, 1) == num_splits - 1;
        if (is_last) *counter = 0;          // ready for the next launch (or graph replay)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // ---- the last split: every row's weights, then out = the weighted sum ----------------------
    // Row i's partials (m_s, l_s) and the suffix's lse give M = max(lse, m_s) and the weights
    //   w_s = 2^(m_s - M) / den,  w_suffix = 2^(lse - M) / den,  den = 2^(lse - M) + sum_s l_s 2^(m_s - M)
    // (a row past the last gets no weights: nothing reads them). Other blocks' partials are read
    // through L2 (__ldcg): L1 is not coherent across SMs. The stages are free: every copy landed
    // and every warp passed the barriers above after its last tile.
    float* const weight = reinterpret_cast<float*>(smem);          // [MAX_SPLITS + 1][BLOCK_Q]
    if (threadIdx.x < BLOCK_Q && tile_q0 + (int)threadIdx.x < rows) {
        const int i = threadIdx.x;
        float2 ml[MAX_SPLITS];
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s)
            ml[s] = s < num_splits ? __ldcg(tile_ml + s * BLOCK_Q + i) : make_float2(-CUDART_INF_F, 0.0f);
        const float lse_s = lse[row_pair(tile_q0 + i, kv_head, group, num_q_heads)];
        float m = lse_s;
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s) m = fmaxf(m, ml[s].x);     // finite: every split's is
        float den = fast_exp2(lse_s - m);
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s) den = fmaf(ml[s].y, fast_exp2(ml[s].x - m), den);
        const float inv = 1.0f / den;       // den >= 1: the term of the largest max is
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s)
            if (s < num_splits) weight[s * BLOCK_Q + i] = fast_exp2(ml[s].x - m) * inv;
        weight[MAX_SPLITS * BLOCK_Q + i] = fast_exp2(lse_s - m) * inv;
    }
    __syncthreads();
    // Each thread sums MERGE_QUADS quads (4 dims of one row) over the splits in split order, the
    // suffix last: the same sums whichever split merges, so the result never depends on timing.
    constexpr int QUADS_PER_ROW = D / 4, QUADS = BLOCK_Q * QUADS_PER_ROW;
    static_assert(QUADS % (THREADS * MERGE_QUADS) == 0, "whole rounds of quads");
    const float4* parts = reinterpret_cast<const float4*>(tile_o);
    for (int e0 = threadIdx.x; e0 < QUADS; e0 += THREADS * MERGE_QUADS) {
        float4 acc[MERGE_QUADS];
#pragma unroll
        for (int u = 0; u < MERGE_QUADS; ++u) acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 2
        for (int s = 0; s < num_splits; ++s) {
            float4 part[MERGE_QUADS];
#pragma unroll
            for (int u = 0; u < MERGE_QUADS; ++u) part[u] = __ldcg(parts + (size_t)s * QUADS + e0 + u * THREADS);
#pragma unroll
            for (int u = 0; u < MERGE_QUADS; ++u) {
                const float w = weight[s * BLOCK_Q + (e0 + u * THREADS) / QUADS_PER_ROW];
                acc[u].x = fmaf(w, part[u].x, acc[u].x);
                acc[u].y = fmaf(w, part[u].y, acc[u].y);
                acc[u].z = fmaf(w, part[u].z, acc[u].z);
                acc[u].w = fmaf(w, part[u].w, acc[u].w);
            }
        }
#pragma unroll
        for (int u = 0; u < MERGE_QUADS; ++u) {
            const int e = e0 + u * THREADS, i = e / QUADS_PER_ROW, row = tile_q0 + i;
            if (row >= rows) continue;
            const float w = weight[MAX_SPLITS * BLOCK_Q + i];
            bf16* dst = out + (size_t)row_pair(row, kv_head, group, num_q_heads) * D + 4 * (e % QUADS_PER_ROW);
            const uint2 raw = *reinterpret_cast<const uint2*>(dst);   // attention_decode's out_s
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
            *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2(fmaf(w, lo.x, acc[u].x), fmaf(w, lo.y, acc[u].y)),
                                                        pack_bf16x2(fmaf(w, hi.x, acc[u].z), fmaf(w, hi.y, acc[u].w)));
        }
    }
}

}  // namespace

// Kernels: attention_cascade_prefix_d{D}, any GQA group (a runtime argument: it only maps rows to
// heads). prefix_len: the device int above; out and lse: attention_decode's, merged into `out`;
// partial_o [tiles][splits][BLOCK_Q][D] and partial_ml [tiles][splits][BLOCK_Q][2] fp32 and
// split_counters [tiles] (zero before the first launch), tiles = gridDim.x * gridDim.y.
#define CASCADE_PREFIX_KERNEL(D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_cascade_prefix_d##D(         \
        bf16* out, const float* lse, float* partial_o, float* partial_ml, int* split_counters,   \
        const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,               \
        const int* block_tables, const int* prefix_len, int num_seqs, int block_size,            \
        int num_kv_heads, int group, float scale) {                                              \
        cascade_prefix<D>(out, lse, partial_o, partial_ml, split_counters, q, q_row_stride,      \
                          k_cache, v_cache, block_tables, prefix_len, num_seqs, block_size,      \
                          num_kv_heads, group, scale);                                           \
    }
CASCADE_PREFIX_KERNEL(64)
CASCADE_PREFIX_KERNEL(128)
CASCADE_PREFIX_KERNEL(256)
