// Decode attention over the paged KV cache (PagedAttention), split over the context (flash
// decoding); the last split of each (sequence, kv head) to finish merges them.
//
// One new query token per sequence (token index = sequence index). Grid: (num_seqs *
// num_kv_heads, 1, max_splits), the kv heads of one sequence adjacent so that the blocks reading
// the same cache pages run together; block: 256 threads. One block serves all GROUP query heads
// that share one kv head, so each K/V row is read from memory once per GQA group.
//
// Splits. The grid's split count is fixed per batch size (a CUDA graph fixes the grid); a
// sequence uses num_splits = min(max_splits, ceil(context / MIN_SPLIT)) of them (one for
// a context of at most ONE_SPLIT_TOKENS; MIN_SPLIT = one STEP for each warp of the block), each of
// per_split tokens (a multiple of STEP), and the surplus blocks leave at once. The count depends
// only on the batch size and the context, never on timing, so results are deterministic.
//
// Inside a block each warp owns every WARPS-th step of STEP = 16 tokens of the block's split and
// streams them through its own ring of STAGES shared-memory stages with cp.async (16-byte
// copies, rows of tokens past the end zero-filled), so no __syncthreads runs in the main loop and
// (STAGES - 1) steps of K and V per warp are in flight while one is used. The maths is on the
// tensor cores, with the token axis as the MMA's M = 16 and the query heads as its N = 8 (any
// GROUP <= 8 fits one n-tile):
//   S^T[16 tokens x 8 heads]  = K[16 x D] . Q^T[D x 8]      (A = K via ldmatrix, B = q in registers)
//   O^T[D x 8 heads]         += V^T[D x 16] . P^T[16 x 8]   (A = V via ldmatrix.trans, B = P^T)
// P^T's B fragment is S^T's accumulator fragment transposed per 8 x 8 block (movmatrix), so the
// probabilities never leave registers. Online softmax per warp in base 2 (running max m and sum
// l per head); at the end the block merges its warps through shared memory.
//
// With one split the block writes the normalised result to `out`. With several, each block
// writes its unnormalised accumulator and (m, l) to the workspace, then counts itself done on
// split_counters[seq, kv_head]; the block that finishes last merges all splits into `out` and
// resets the counter to 0 for the next launch (no separate reduce launch; the counters must start
// at zero: the arena is zeroed at allocation).
//
// Shared memory is dynamic: SMEM_BYTES_PER_DIM * head_dim bytes (the launcher passes it).
// K/V rows sit in it with their 16-byte chunks XOR-swizzled by (row % 8), so the 8 rows an
// ldmatrix phase reads fall in distinct banks.
//
// Cascade suffix (attention_cascade.cu's header). Two optional pointers, both nullable:
//   first_position  one device int for the batch: each sequence attends to positions
//                   max(first_position, its window's first) .. ctx - 1 only (never past ctx: a
//                   range left empty gives l = 0, out = 0). A cascade step sets it to the shared
//                   prefix's length, which attention_cascade_prefix reads once for every sequence;
//                   it is read from device memory (the arena's cascade_prefix_len, a host upload
//                   like context_lens) so that one captured decode graph serves every prefix
//                   length, 0 included. nullptr: from 0, as without cascade.
//   lse_out         [num_seqs, num_q_heads] fp32: the base-2 log-sum-exp of the scaled scores
//                   attended to, lse = m + log2(l) with m and l as kept here (scores times
//                   scale * log2(e)), i.e. the natural log-sum-exp times log2(e); -inf where the
//                   range is empty. Written by the one-split path and by the merging block.
// With `out` normalised, (out, lse) is the partial (o, m, l) of reference/cascade.py up to its
// scale: o / l = out and l 2^m = 2^lse, which is all its exact merge needs.
//
// PDL-aware: launched with programmatic stream serialization; every attention block lets the
// consumer launch at once and waits for the producer after issuing its first K/V copies (below).
//
// Early K/V. At batch 1 the kernel is ~4 us and latency-bound, and its first K/V copies would
// wait behind the wait for the qkv GEMV. Yet at decode that GEMV (or rope_write_kv) writes only
// each sequence's newest K/V row (position ctx - 1: one new token per sequence); every other row
// was written by earlier steps, complete before this graph or eager step started, and
// block_tables / context_lens / block_table_width are host uploads, stream-ordered before it. So
// a block computes its split and slots and issues the prologue's cp.async copies BEFORE
// wait_for_producer(), all but the newest row's: that row gets no cp.async at all (an async
// zero-fill could land after the store below). After the wait, if the newest row lies in a
// prologue step, the lanes that would have copied it load it with plain coherent loads
// (load_fresh: the producer just wrote it) and store it to the same swizzled place; the main
// loop's cp_async_wait + __syncwarp publish it to the warp like the copies. Steps issued in the
// main loop come after the wait anyway. The same bytes land in the same shared memory as if every
// copy waited, so the result is that of the plain order, bit for bit. Measured at batch 1: 22 us
// less GPU time per step on the Llama-1B preset, 54 us on SmolLM2-135M (H200, 2026-12-04,
// 8470bd1). Its launches must be decode steps', whose sole K/V writer still running is the one of
// the newest rows.
#include <math_constants.h>
#include "common.cuh"

namespace {

// 8 warps a block: at batch 1 a block's tokens are on the step's critical path, and 8 warps take
// half as many steps each as 4 did (at most 4 up to ONE_SPLIT_TOKENS, the first PROLOGUE_STEPS
// of them copied before the wait). At large batches an SM holds as many warps either way (2
// blocks of 8 at 96 KB of shared memory for head_dim 64, or 4 of 4 at 48 KB).
constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int STEP = 16;                          // tokens per warp step: the MMA's M
constexpr int STAGES = 3;                         // cp.async ring depth per warp
// Steps a warp copies before its first wait: all STAGES (a stage is refilled right after its own
// step's maths). The prologue's copies go out before the PDL wait, so a full ring hides STAGES
// steps a warp behind the producer (contexts up to WARPS * STAGES * STEP = 384 tokens at batch
// 1). Against STAGES - 1 (each stage refilled before the wait for the step STAGES - 1 later):
// bench latency 1,050 -> 1,058 tok/s on the 1B preset, batch64 unchanged within noise (H100,
// 2026-12-06, 2510e25).
constexpr int PROLOGUE_STEPS = STAGES;
// Contexts up to ONE_SPLIT_TOKENS run in one split: the merge of several (a fence, an atomic
// and two rounds of L2 reads in the last block) costs more at batch 1 than the parallel blocks
// save. Measured end to end (`bench --workload latency`, contexts 128..384): 8 warps with one
// split up to 512 tokens against 4 warps with one split up to 256 (then 5-6 splits of 64):
// Llama-1B 1,020 -> 1,042 tok/s, SmolLM2-135M 2,310 -> 2,505 (H100, 2026-12-05, 2ca2842).
constexpr int ONE_SPLIT_TOKENS = 512;
constexpr int MAX_SPLITS = 32;                    // the merge gives each split one lane
constexpr int MERGE_UNROLL = 8;                   // partials each merging thread loads at once
constexpr int SMEM_BYTES_PER_DIM = WARPS * STAGES * STEP * 2 * 2;   // x head_dim: K and V rows, bf16
// head_dim 256 (Gemma 3): 8 warps' rings would take SMEM_BYTES_PER_DIM * 256 = 384 KB, above an
// SM's 227 KB; those blocks run 4 warps, with 4 * 3 stages * 16 rows * 2 (K, V) * 512 bytes =
// 192 KB, as head_dim 128's 8 warps have (and 4 warps' shorter minimum split).
constexpr int WIDE_HEAD_DIM = 256;
constexpr int WIDE_THREADS = 128;
constexpr int WIDE_SMEM_BYTES_PER_DIM = (WIDE_THREADS / 32) * STAGES * STEP * 2 * 2;

// A block's threads and dynamic shared memory at one head_dim (gpu/ops/attention.py: the same rule).
__host__ __device__ constexpr int decode_threads(int head_dim) {
    return head_dim >= WIDE_HEAD_DIM ? WIDE_THREADS : THREADS;
}
__host__ __device__ constexpr int decode_smem_bytes(int head_dim) {
    return (head_dim >= WIDE_HEAD_DIM ? WIDE_SMEM_BYTES_PER_DIM : SMEM_BYTES_PER_DIM) * head_dim;
}

// 16-byte register -> shared store (the newest K/V row, header: early K/V)
__device__ __forceinline__ void st_shared16(uint32_t dst, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// the 8 x 8 bf16 block held one b32 per lane (row lane/4, columns 2*(lane%4) + {0, 1}), transposed
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
    uint32_t y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

template <int HEAD_DIM, int GROUP, bool WINDOWED>
__device__ __forceinline__ void decode_attention(
    bf16* out, float* __restrict__ partial_out, float* __restrict__ partial_ml,
    int* __restrict__ split_counters, float* lse_out, const bf16* q, int q_row_stride, const bf16* k_cache,
    const bf16* v_cache, const int* __restrict__ block_tables, const int* __restrict__ block_table_width,
    const int* __restrict__ context_lens, const int* __restrict__ first_position, int block_size,
    int num_kv_heads, float scale, int window) {
    static_assert(GROUP >= 1 && GROUP <= 8, "the query heads of a group are one MMA n-tile of 8");
    constexpr int BLOCK_THREADS = decode_threads(HEAD_DIM), BLOCK_WARPS = BLOCK_THREADS / 32;
    constexpr int MIN_SPLIT = BLOCK_WARPS * STEP;    // a split gives every warp at least one step
    static_assert(HEAD_DIM % 64 == 0, "rows are whole 8 x 16-byte swizzle groups");
    constexpr int DSTEPS = HEAD_DIM / 16;            // MMA k-steps of the scores = m-tiles of O^T
    constexpr int CHUNKS = HEAD_DIM / 8;             // 16-byte chunks per K/V row
    constexpr int ROW_BYTES = HEAD_DIM * 2;
    constexpr int TILE_BYTES = STEP * ROW_BYTES;     // one step of K (or V)
    constexpr int STAGE_BYTES = 2 * TILE_BYTES;
    constexpr int COPIES = STEP * CHUNKS / 32;       // 16-byte copies per lane per tensor per step
    static_assert(BLOCK_WARPS * STAGES * STAGE_BYTES == decode_smem_bytes(HEAD_DIM), "launcher's size");
    extern __shared__ __align__(128) unsigned char smem[];
    // PDL (common.cuh): the o projection that follows may launch at once and stream its weights
    // under this kernel. q and the new token's K/V are the qkv GEMV's (or rope_write_kv's)
    // output, and `out` may still be read by the previous layer's o projection, so nothing but
    // the early K/V copies of older rows (header) goes before the wait below (those pointers
    // carry no __restrict__, so no read-only load of them can be hoisted above it).
    allow_consumer();

    const int seq = blockIdx.x / num_kv_heads, kv_head = blockIdx.x % num_kv_heads, split = blockIdx.z;
    const int num_q_heads = num_kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    const int ctx = context_lens[seq];
    // The positions read: first .. ctx - 1; a sliding layer's window (WINDOWED, window > 0) starts
    // at ctx - window (the query at ctx - 1 sees its last `window` positions, its own included),
    // a cascade suffix at *first_position (header), and the splits cut that span only, beginning
    // in its first block. first = ctx leaves no position: every warp has 0 steps.
    int first = WINDOWED && window > 0 && ctx > window ? ctx - window : 0;
    if (first_position != nullptr) first = min(max(first, *first_position), ctx);
    const int span = ctx - first;
    const int wanted = span <= ONE_SPLIT_TOKENS
        ? 1 : max(1, min(min((int)gridDim.z, MAX_SPLITS), (span + MIN_SPLIT - 1) / MIN_SPLIT));
    const int per_split = max(STEP, ((span + wanted - 1) / wanted + STEP - 1) / STEP * STEP);
    const int num_splits = max(1, (span + per_split - 1) / per_split);   // no split is left empty
    if (split >= num_splits) return;
    const int begin = first + split * per_split, end = min(ctx, begin + per_split);
    const int split_steps = max(0, (end - begin + STEP - 1) / STEP);
    const int steps = split_steps > warp ? (split_steps - warp + BLOCK_WARPS - 1) / BLOCK_WARPS : 0;   // this warp's
    // the row stride is read from device memory so a captured CUDA graph serves any width
    const int* table = block_tables + (size_t)seq * *block_table_width;
    const int bs_shift = __ffs(block_size) - 1;      // block_size is a power of two
    const size_t kv_row = (size_t)num_kv_heads * HEAD_DIM;
    const bf16* k_head = k_cache + (size_t)kv_head * HEAD_DIM;
    const bf16* v_head = v_cache + (size_t)kv_head * HEAD_DIM;
    auto step_begin = [&](int i) { return begin + (warp + i * BLOCK_WARPS) * STEP; };

    // Lane t < STEP: the cache slot of token t of this warp's step i, or -1 past the end.
    auto load_slot = [&](int i) -> int {
        const int pos = step_begin(i) + lane;
        if (i >= steps || lane >= STEP || pos >= end) return -1;
        return __ldg(table + (pos >> bs_shift)) * block_size + (pos & (block_size - 1));
    };
    const uint32_t ring = smem_addr(smem) + warp * STAGES * STAGE_BYTES;
    // Copy step i's K and V rows into stage `stage`; `slot` is load_slot(i) (each lane's row's
    // slot comes from the lane that looked it up). Row `skip` of the step gets no copy at all.
    auto issue = [&](int stage, int slot, int skip) {
        const uint32_t k_dst = ring + stage * STAGE_BYTES, v_dst = k_dst + TILE_BYTES;
        const int chunk = lane % CHUNKS;
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            const int row = lane / CHUNKS + j * (32 / CHUNKS);
            const int row_slot = __shfl_sync(0xffffffffu, slot, row);
            const size_t src = row_slot >= 0 ? (size_t)row_slot * kv_row + chunk * 8 : 0;
            const uint32_t dst = row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
            const int bytes = row_slot >= 0 ? 16 : 0;
            if (row != skip) {
                cp_async16(k_dst + dst, k_head + src, bytes);
                cp_async16(v_dst + dst, v_head + src, bytes);
            }
        }
    };

    // Prologue: the first PROLOGUE_STEPS steps in flight (empty groups keep the group count
    // uniform), before the wait, without the newest row (pos ctx - 1; header: early K/V). Every
    // prologue slot (and the first refill's) is looked up before the first copy goes out:
    // issue()'s cp.async is asm volatile with a "memory" clobber, so a table load written after
    // it waits for it, one L2 round trip a step in series (seen in the SASS); up front the
    // lookups overlap.
    const int newest = ctx - 1;
    const int newest_slot = newest >= 0 ? __ldg(table + (newest >> bs_shift)) * block_size + (newest & (block_size - 1)) : 0;
    int prologue_slot[PROLOGUE_STEPS + 1];
#pragma unroll
    for (int i = 0; i <= PROLOGUE_STEPS; ++i) prologue_slot[i] = load_slot(i);
#pragma unroll
    for (int i = 0; i < PROLOGUE_STEPS; ++i) {
        if (i < steps) issue(i, prologue_slot[i], newest - step_begin(i));
        cp_async_commit();
    }
    int next_slot = prologue_slot[PROLOGUE_STEPS];
    wait_for_producer();
    // The newest row, now written, where a prologue step holds it: the lanes issue() gives that
    // row copy it with coherent loads into the same swizzled place (a later step's copy of it is
    // issued in the main loop, after the wait, as usual).
#pragma unroll
    for (int i = 0; i < PROLOGUE_STEPS; ++i) {
        const int row = newest - step_begin(i);
        if (i < steps && row >= 0 && row < STEP && lane / CHUNKS == row % (32 / CHUNKS)) {
            const int chunk = lane % CHUNKS;
            const size_t src = (size_t)newest_slot * kv_row + chunk * 8;
            const uint4 k = load_fresh(k_head + src), v = load_fresh(v_head + src);
            const uint32_t dst = ring + i * STAGE_BYTES + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
            st_shared16(dst, k);
            st_shared16(dst + TILE_BYTES, v);
        }
    }

    // q as the B operand of S^T = K . Q^T: lane holds head lane/4, dims 2*(lane%4) + {0,1} (+8)
    // of each 16-dim k-step; heads >= GROUP are zero columns.
    uint32_t qf[DSTEPS][2];
    {
        const int h = lane / 4;
        const bf16* qh = q + (size_t)seq * q_row_stride + (size_t)(kv_head * GROUP + min(h, GROUP - 1)) * HEAD_DIM;
#pragma unroll
        for (int t = 0; t < DSTEPS; ++t) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint32_t v = *reinterpret_cast<const uint32_t*>(qh + 16 * t + 8 * half + 2 * (lane % 4));
                qf[t][half] = h < GROUP ? v : 0u;
            }
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;   // scores in base 2: exp(x) = 2^(x log2 e)

    // Per lane: heads h0 = 2*(lane%4) and h0 + 1 (the accumulator columns it holds).
    float m0 = -CUDART_INF_F, m1 = -CUDART_INF_F, l0 = 0.0f, l1 = 0.0f;
    float o[DSTEPS][4];   // O^T: rows (dims) 16t + lane/4 (+8), columns h0, h0 + 1
#pragma unroll
    for (int t = 0; t < DSTEPS; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;

    // Step k lives in stage k % STAGES. Before step i's wait STAGES + i groups are committed
    // (STAGES in the prologue and one for each earlier step), so waiting with STAGES - 1 left in
    // flight means step i's copies (and every earlier step's) have landed.
    auto refill = [&](int step) {
        if (step < steps) issue(step % STAGES, next_slot, -1);
        cp_async_commit();
        next_slot = load_slot(step + 1);
    };
    int stage = 0;
    for (int i = 0; i < steps; ++i) {
        cp_async_wait<STAGES - 1>();
        __syncwarp();

        const uint32_t k_tile = ring + stage * STAGE_BYTES, v_tile = k_tile + TILE_BYTES;
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // S^T: tokens lane/4 (s0, s1) and lane/4 + 8 (s2, s3)
#pragma unroll
        for (int t = 0; t < DSTEPS; ++t) {
            const int row = lane % 16, chunk = 2 * t + lane / 16;
            uint32_t a[4];
            ldmatrix_x4(a, k_tile + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
            mma_bf16(s, a[0], a[1], a[2], a[3], qf[t][0], qf[t][1]);
        }
        const int tok = step_begin(i) + lane / 4;
        const bool valid_lo = tok < end, valid_hi = tok + 8 < end;
        s[0] = valid_lo ? s[0] * scale_log2 : -CUDART_INF_F;
        s[1] = valid_lo ? s[1] * scale_log2 : -CUDART_INF_F;
        s[2] = valid_hi ? s[2] * scale_log2 : -CUDART_INF_F;
        s[3] = valid_hi ? s[3] * scale_log2 : -CUDART_INF_F;
        float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {   // over the 8 token rows (lanes with equal lane%4)
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        // Token 0 of every step is valid, so the new maxima are finite; alpha = 0 on the first step.
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float alpha0 = fast_exp2(m0 - n0), alpha1 = fast_exp2(m1 - n1);
        m0 = n0;
        m1 = n1;
        const float p0 = fast_exp2(s[0] - n0), p1 = fast_exp2(s[1] - n1), p2 = fast_exp2(s[2] - n0), p3 = fast_exp2(s[3] - n1);
        l0 = l0 * alpha0 + (p0 + p2);
        l1 = l1 * alpha1 + (p1 + p3);
        const uint32_t pf[2] = {movmatrix_trans(pack_bf16x2(p0, p1)), movmatrix_trans(pack_bf16x2(p2, p3))};
#pragma unroll
        for (int t = 0; t < DSTEPS; ++t) {
            o[t][0] *= alpha0;
            o[t][1] *= alpha1;
            o[t][2] *= alpha0;
            o[t][3] *= alpha1;
            const int row = lane % 8 + (lane / 16) * 8, chunk = 2 * t + (lane / 8) % 2;
            uint32_t a[4];
            ldmatrix_x4_trans(a, v_tile + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
            mma_bf16(o[t], a[0], a[1], a[2], a[3], pf[0], pf[1]);
        }
        __syncwarp();   // every lane is done with this stage before it is refilled
        refill(i + STAGES);   // into the stage just used
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    cp_async_wait<0>();
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {      // each lane summed its own token rows
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }

    // Merge the warps through shared memory (the stages are free once every warp is here).
    __syncthreads();
    float* warp_o = reinterpret_cast<float*>(smem);      // [BLOCK_WARPS][GROUP][HEAD_DIM]
    float* warp_m = warp_o + BLOCK_WARPS * GROUP * HEAD_DIM;   // [BLOCK_WARPS][GROUP]
    float* warp_l = warp_m + BLOCK_WARPS * GROUP;
    {
        const int h0 = 2 * (lane % 4), h1 = h0 + 1;
#pragma unroll
        for (int t = 0; t < DSTEPS; ++t) {
            const int d = 16 * t + lane / 4;
            if (h0 < GROUP) {
                warp_o[(warp * GROUP + h0) * HEAD_DIM + d] = o[t][0];
                warp_o[(warp * GROUP + h0) * HEAD_DIM + d + 8] = o[t][2];
            }
            if (h1 < GROUP) {
                warp_o[(warp * GROUP + h1) * HEAD_DIM + d] = o[t][1];
                warp_o[(warp * GROUP + h1) * HEAD_DIM + d + 8] = o[t][3];
            }
        }
        if (lane < 4 && h0 < GROUP) {
            warp_m[warp * GROUP + h0] = m0;
            warp_l[warp * GROUP + h0] = l0;
        }
        if (lane < 4 && h1 < GROUP) {
            warp_m[warp * GROUP + h1] = m1;
            warp_l[warp * GROUP + h1] = l1;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += BLOCK_THREADS) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float m = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < BLOCK_WARPS; ++w) m = fmaxf(m, warp_m[w * GROUP + g]);
        float acc = 0.0f, l = 0.0f;
#pragma unroll
        for (int w = 0; w < BLOCK_WARPS; ++w) {
            const float mw = warp_m[w * GROUP + g];
            const float weight = mw == -CUDART_INF_F ? 0.0f : fast_exp2(mw - m);   // a warp with no tokens
            acc += weight * warp_o[(w * GROUP + g) * HEAD_DIM + d];
            l += weight * warp_l[w * GROUP + g];
        }
        const int head = kv_head * GROUP + g;
        if (num_splits == 1) {
            out[((size_t)seq * num_q_heads + head) * HEAD_DIM + d] = __float2bfloat16(l > 0.0f ? acc / l : 0.0f);
            if (lse_out != nullptr && d == 0)
                lse_out[(size_t)seq * num_q_heads + head] = l > 0.0f ? m + log2f(l) : -CUDART_INF_F;
        } else {
            // a fixed stride of MAX_SPLITS per (sequence, head): sequences split differently
            // (their contexts differ) must never share workspace rows
            const size_t idx = ((size_t)seq * num_q_heads + head) * MAX_SPLITS + split;
            partial_out[idx * HEAD_DIM + d] = acc;
            if (d == 0) {
                partial_ml[2 * idx] = m;
                partial_ml[2 * idx + 1] = l;
            }
        }
    }
    if (num_splits == 1) return;

    // Count this split done; the last one merges (threadFenceReduction pattern).
    __shared__ bool is_last;
    __threadfence();              // our partials are visible device-wide before we count
    __syncthreads();
    int* counter = split_counters + (size_t)seq * num_kv_heads + kv_head;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == num_splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s. Other blocks'
    // partials are read through L2 (__ldcg): L1 is not coherent across SMs. First one warp per
    // head turns the splits' (m, l) into weights (one split per lane) ...
    float* weights = reinterpret_cast<float*>(smem);                  // [GROUP][MAX_SPLITS]
    for (int g = warp; g < GROUP; g += BLOCK_WARPS) {
        const size_t base = ((size_t)seq * num_q_heads + kv_head * GROUP + g) * MAX_SPLITS;
        float2 ml = make_float2(-CUDART_INF_F, 0.0f);
        if (lane < num_splits) ml = __ldcg(reinterpret_cast<const float2*>(partial_ml) + base + lane);
        const float m = warp_max(ml.x);
        const float w = ml.x == -CUDART_INF_F ? 0.0f : fast_exp2(ml.x - m);
        const float den = warp_sum(w * ml.y);
        if (lane < num_splits) weights[g * MAX_SPLITS + lane] = den > 0.0f ? w / den : 0.0f;
        if (lse_out != nullptr && lane == 0)
            lse_out[(size_t)seq * num_q_heads + kv_head * GROUP + g] = den > 0.0f ? m + log2f(den) : -CUDART_INF_F;
    }
    __syncthreads();
    // ... then each thread sums 4 output dims over a slice of the splits, MERGE_UNROLL partials
    // in flight at once; slices (when a head group has fewer quads than the block has threads)
    // are added in a fixed order, so the result never depends on timing.
    constexpr int QUADS = GROUP * HEAD_DIM / 4;
    constexpr int SLICES = QUADS >= BLOCK_THREADS ? 1 : BLOCK_THREADS / QUADS;
    float4* slice_sum = reinterpret_cast<float4*>(weights + GROUP * MAX_SPLITS);   // [SLICES][QUADS]
    for (int e = threadIdx.x; e < QUADS * SLICES; e += BLOCK_THREADS) {
        const int quad = e % QUADS, slice = e / QUADS;
        const int g = quad / (HEAD_DIM / 4), d4 = quad % (HEAD_DIM / 4);
        const size_t base = ((size_t)seq * num_q_heads + kv_head * GROUP + g) * MAX_SPLITS;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = slice; s0 < num_splits; s0 += SLICES * MERGE_UNROLL) {
            float4 part[MERGE_UNROLL];
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; ++u) {
                const int s = s0 + u * SLICES;
                part[u] = s < num_splits ? __ldcg(reinterpret_cast<const float4*>(partial_out + (base + s) * HEAD_DIM) + d4)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; ++u) {
                const int s = s0 + u * SLICES;
                const float w = s < num_splits ? weights[g * MAX_SPLITS + s] : 0.0f;
                acc.x += w * part[u].x;
                acc.y += w * part[u].y;
                acc.z += w * part[u].z;
                acc.w += w * part[u].w;
            }
        }
        if (SLICES == 1) {
            bf16* dst = out + ((size_t)seq * num_q_heads + kv_head * GROUP + g) * HEAD_DIM + 4 * d4;
            reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(acc.x, acc.y);
            reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(acc.z, acc.w);
        } else {
            slice_sum[slice * QUADS + quad] = acc;
        }
    }
    if (SLICES > 1) {
        __syncthreads();
        for (int quad = threadIdx.x; quad < QUADS; quad += BLOCK_THREADS) {
            float4 acc = slice_sum[quad];
#pragma unroll
            for (int sl = 1; sl < SLICES; ++sl) {
                const float4 v = slice_sum[sl * QUADS + quad];
                acc.x += v.x;
                acc.y += v.y;
                acc.z += v.z;
                acc.w += v.w;
            }
            const int g = quad / (HEAD_DIM / 4), d4 = quad % (HEAD_DIM / 4);
            bf16* dst = out + ((size_t)seq * num_q_heads + kv_head * GROUP + g) * HEAD_DIM + 4 * d4;
            reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(acc.x, acc.y);
            reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(acc.z, acc.w);
        }
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

}  // namespace

// Kernels: attention_decode_d{D}_g{G} over the whole context, attention_decode_window_d{D}_g{G}
// over the last `window` positions (0: the whole context), a sliding layer's (its own
// instantiations, so the full-context kernels' code has no window in it). lse_out and
// first_position may be null (header: cascade suffix).
#define DECODE_ATTENTION_KERNEL(D, G)                                                            \
    extern "C" __global__ void __launch_bounds__(decode_threads(D)) attention_decode_d##D##_g##G( \
        bf16* out, float* partial_out, float* partial_ml, int* split_counters, float* lse_out,   \
        const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,               \
        const int* block_tables, const int* block_table_width, const int* context_lens,          \
        const int* first_position, int block_size, int num_kv_heads, float scale) {              \
        decode_attention<D, G, false>(out, partial_out, partial_ml, split_counters, lse_out, q,  \
                                      q_row_stride, k_cache, v_cache, block_tables,              \
                                      block_table_width, context_lens, first_position,           \
                                      block_size, num_kv_heads, scale, 0);                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(decode_threads(D)) attention_decode_window_d##D##_g##G( \
        bf16* out, float* partial_out, float* partial_ml, int* split_counters, float* lse_out,   \
        const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,               \
        const int* block_tables, const int* block_table_width, const int* context_lens,          \
        const int* first_position, int block_size, int num_kv_heads, float scale, int window) {  \
        decode_attention<D, G, true>(out, partial_out, partial_ml, split_counters, lse_out, q,   \
                                     q_row_stride, k_cache, v_cache, block_tables,               \
                                     block_table_width, context_lens, first_position,            \
                                     block_size, num_kv_heads, scale, window);                   \
    }
// head_dim x group: Llama 3.2 1B is (64, 4), 3B (128, 3), 3.1 8B (128, 4), the tiny preset (64, 2);
// Qwen2.5 0.5B (64, 7), 1.5B (128, 6), 3B (128, 8), 7B (128, 7); Qwen3 0.6B-1.7B (128, 2), 4B-8B
// (128, 4); Mistral 7B (128, 4); Gemma 3 1B (256, 4), 4B-27B (256, 2)
DECODE_ATTENTION_KERNEL(64, 1)
DECODE_ATTENTION_KERNEL(64, 2)
DECODE_ATTENTION_KERNEL(64, 3)
DECODE_ATTENTION_KERNEL(64, 4)
DECODE_ATTENTION_KERNEL(64, 5)
DECODE_ATTENTION_KERNEL(64, 6)
DECODE_ATTENTION_KERNEL(64, 7)
DECODE_ATTENTION_KERNEL(64, 8)
DECODE_ATTENTION_KERNEL(128, 1)
DECODE_ATTENTION_KERNEL(128, 2)
DECODE_ATTENTION_KERNEL(128, 3)
DECODE_ATTENTION_KERNEL(128, 4)
DECODE_ATTENTION_KERNEL(128, 5)
DECODE_ATTENTION_KERNEL(128, 6)
DECODE_ATTENTION_KERNEL(128, 7)
DECODE_ATTENTION_KERNEL(128, 8)
DECODE_ATTENTION_KERNEL(256, 1)
DECODE_ATTENTION_KERNEL(256, 2)
DECODE_ATTENTION_KERNEL(256, 4)
DECODE_ATTENTION_KERNEL(256, 8)
