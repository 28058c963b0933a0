// Decode attention over the paged KV cache (PagedAttention), split over the context
// (flash decoding) when it is long; the last split of each (sequence, kv head) to finish merges
// them.
//
// One new query token per sequence (token index = sequence index). Grid: (num_seqs,
// num_kv_heads, max_splits); block: 128 threads. A sequence uses min(max_splits,
// ceil(context / MIN_SPLIT_TOKENS)) of its splits. A block serves all `group` query heads that
// share one kv head, so each K/V row is read once per GQA group, over split blockIdx.z of the
// sequence's context. The split is walked in chunks of CHUNK tokens with an online softmax
// (running max m, running sum l, accumulators rescaled per chunk), so any context length works
// with a fixed grid — which is what a captured CUDA graph needs.
//
// Thread layout: LANES = HEAD_DIM / 8 consecutive lanes cover one K/V row with 16-byte loads; a
// warp scores 32 / LANES tokens at once.
//
// With one split the block writes the normalised result to `out`. With several, each block
// writes its unnormalised accumulator and (m, l) to the workspace, then counts itself done on
// split_counters[seq, kv_head]; the block that finishes last merges all splits into `out` and
// resets the counter to 0 for the next launch (so no separate reduce launch is needed, and the
// counters must start at zero: the arena is zeroed at allocation).
#include <math_constants.h>
#include "common.cuh"

namespace {

constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr int CHUNK = 256;
constexpr int MIN_SPLIT_TOKENS = 128;
constexpr int UNROLL = 4;        // K/V rows each thread loads before using any of them

// GROUP (query heads per kv head) is a template parameter: the q and accumulator registers and
// the shared buffers are sized exactly, which keeps registers low enough for several blocks per
// SM (a run-time group sized for the largest case halved the occupancy).
template <int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_attention(
    bf16* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_ml,
    int* __restrict__ split_counters, const bf16* __restrict__ q, int q_row_stride, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ block_table_width,
    const int* __restrict__ context_lens, int block_size, int num_kv_heads, float scale) {
    constexpr int LANES = HEAD_DIM / 8;
    constexpr int ROWS_PER_WARP = 32 / LANES;
    constexpr int ROWS_PER_PASS = ROWS_PER_WARP * WARPS;

    __shared__ float probs[GROUP][CHUNK];
    __shared__ float m_s[GROUP], l_s[GROUP], alpha_s[GROUP];
    __shared__ float reduce_buf[WARPS][GROUP][HEAD_DIM];

    const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const int num_q_heads = num_kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_in_pass = warp * ROWS_PER_WARP + lane / LANES;
    const int dim0 = (lane % LANES) * 8;

    // The grid has a fixed number of splits (a CUDA graph fixes it per batch size), but a short
    // context is split only into pieces of at least MIN_SPLIT_TOKENS: the surplus blocks leave at
    // once, and a context of <= MIN_SPLIT_TOKENS takes the single-split path (no merge at all).
    const int ctx = context_lens[seq];
    const int num_splits = max(1, min((int)gridDim.z, (ctx + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS));
    if (split >= num_splits) return;
    const int per_split = (ctx + num_splits - 1) / num_splits;
    const int begin = split * per_split;
    const int end = min(ctx, begin + per_split);
    // the row stride is read from device memory so a captured CUDA graph serves any width
    const int* table = block_tables + (size_t)seq * *block_table_width;
    const size_t kv_row = (size_t)num_kv_heads * HEAD_DIM;
    // element offset of this thread's 8 dims of context position `pos` in the K or V cache
    auto kv_offset = [&](int pos) -> size_t {
        const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
        return slot * kv_row + kv_head * HEAD_DIM + dim0;
    };

    float q_reg[GROUP][8];
    float acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
        load_bf16x8(q + (size_t)seq * q_row_stride + (kv_head * GROUP + g) * HEAD_DIM + dim0,
                    q_reg[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) q_reg[g][i] *= scale;
    }
    if (threadIdx.x < GROUP) {
        m_s[threadIdx.x] = -CUDART_INF_F;
        l_s[threadIdx.x] = 0.0f;
    }
    __syncthreads();

    for (int c0 = begin; c0 < end; c0 += CHUNK) {
        const int n = min(CHUNK, end - c0);
        // 1. raw scores q·k for the chunk's tokens. UNROLL rows per thread are loaded before any
        //    is used, so enough bytes are in flight to cover memory latency. The loop bounds are
        //    uniform across the warp so every lane reaches the shuffles.
        for (int r0 = 0; r0 < n; r0 += ROWS_PER_PASS * UNROLL) {
            uint4 k_raw[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int r = r0 + u * ROWS_PER_PASS + row_in_pass;
                k_raw[u] = r < n ? *reinterpret_cast<const uint4*>(k_cache + kv_offset(c0 + r)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int r = r0 + u * ROWS_PER_PASS + row_in_pass;
                float k[8];
                unpack_bf16x8(k_raw[u], k);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) s += q_reg[g][i] * k[i];
#pragma unroll
                    for (int off = LANES / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                    if (r < n && lane % LANES == 0) probs[g][r] = s;
                }
            }
        }
        __syncthreads();
        // 2. online softmax update, one warp per head
        for (int g = warp; g < GROUP; g += WARPS) {
            float mx = -CUDART_INF_F;
            for (int r = lane; r < n; r += 32) mx = fmaxf(mx, probs[g][r]);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, warp_max(mx));
            float sum = 0.0f;
            for (int r = lane; r < n; r += 32) {
                const float p = __expf(probs[g][r] - m_new);
                probs[g][r] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = __expf(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
                alpha_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        // 3. rescale the accumulators and add p·v
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] *= alpha_s[g];
        }
        for (int r0 = 0; r0 < n; r0 += ROWS_PER_PASS * UNROLL) {
            uint4 v_raw[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int r = r0 + u * ROWS_PER_PASS + row_in_pass;
                v_raw[u] = r < n ? *reinterpret_cast<const uint4*>(v_cache + kv_offset(c0 + r)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int r = r0 + u * ROWS_PER_PASS + row_in_pass;
                if (r >= n) break;
                float v[8];
                unpack_bf16x8(v_raw[u], v);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float p = probs[g][r];
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += p * v[i];
                }
            }
        }
        __syncthreads();  // probs[] is overwritten by the next chunk
    }

    // Sum the accumulators of the rows a warp handled (lanes with equal lane % LANES) ...
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float a = acc[g][i];
#pragma unroll
            for (int off = LANES; off < 32; off <<= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane < LANES) reduce_buf[warp][g][dim0 + i] = a;
        }
    }
    __syncthreads();
    // ... then across warps, and write out.
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += THREADS) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) a += reduce_buf[w][g][d];
        const int head = kv_head * GROUP + g;
        if (num_splits == 1) {
            const float l = l_s[g];
            out[((size_t)seq * num_q_heads + head) * HEAD_DIM + d] = __float2bfloat16(l > 0.0f ? a / l : 0.0f);
        } else {
            const size_t idx = ((size_t)seq * num_q_heads + head) * num_splits + split;
            partial_out[idx * HEAD_DIM + d] = a;
            if (d == 0) {
                partial_ml[2 * idx] = m_s[g];
                partial_ml[2 * idx + 1] = l_s[g];
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
    // out = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M), M = max_s m_s.
    // Other blocks' partials are read through L2 (__ldcg): L1 is not coherent across SMs.
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += THREADS) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        const int head = kv_head * GROUP + g;
        const size_t base = ((size_t)seq * num_q_heads + head) * num_splits;
        float m_max = -CUDART_INF_F;
        for (int s = 0; s < num_splits; ++s) m_max = fmaxf(m_max, __ldcg(&partial_ml[2 * (base + s)]));
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float m = __ldcg(&partial_ml[2 * (base + s)]);
            if (m == -CUDART_INF_F) continue;  // an empty split
            const float w = __expf(m - m_max);
            den += __ldcg(&partial_ml[2 * (base + s) + 1]) * w;
            num += __ldcg(&partial_out[(base + s) * HEAD_DIM + d]) * w;
        }
        out[((size_t)seq * num_q_heads + head) * HEAD_DIM + d] = __float2bfloat16(den > 0.0f ? num / den : 0.0f);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

}  // namespace

#define DECODE_ATTENTION_KERNEL(D, G)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_decode_d##D##_g##G(          \
        bf16* out, float* partial_out, float* partial_ml, int* split_counters, const bf16* q,    \
        int q_row_stride, const bf16* k_cache, const bf16* v_cache, const int* block_tables,     \
        const int* block_table_width, const int* context_lens, int block_size, int num_kv_heads, \
        float scale) {                                                                           \
        decode_attention<D, G>(out, partial_out, partial_ml, split_counters, q, q_row_stride,    \
                               k_cache, v_cache, block_tables, block_table_width, context_lens,  \
                               block_size, num_kv_heads, scale);                                 \
    }
// head_dim x group: Llama 3.2 1B is (64, 4), 3B (128, 3), 3.1 8B (128, 4); the tiny preset (64, 2)
DECODE_ATTENTION_KERNEL(64, 1)
DECODE_ATTENTION_KERNEL(64, 2)
DECODE_ATTENTION_KERNEL(64, 3)
DECODE_ATTENTION_KERNEL(64, 4)
DECODE_ATTENTION_KERNEL(64, 8)
DECODE_ATTENTION_KERNEL(128, 1)
DECODE_ATTENTION_KERNEL(128, 2)
DECODE_ATTENTION_KERNEL(128, 3)
DECODE_ATTENTION_KERNEL(128, 4)
DECODE_ATTENTION_KERNEL(128, 8)
