// BENCHMARK BASELINE ONLY (benchmarks/prefill_attention_bench.py compiles it; the engine does not):
// the CUDA-core prefill attention that tinyvllm/gpu/cuda/attention_prefill.cu replaced, kept so
// the tensor-core kernel can be timed against it. Same arguments; kernels attention_prefill_simt_d{64,128};
// launch: grid (ceil(max_q_len / BLOCK_Q), num_seqs, num_q_heads), block BLOCK_Q * (D / 64).
//
// Prefill attention: FlashAttention-style tiles with an online softmax, causal mask and GQA,
// reading K and V from the paged cache (written just before by rope_write_kv), so a prompt whose
// prefix is already cached attends to it like to its own tokens.
//
// Sequence i's new tokens are rows query_start[i] .. query_start[i+1]-1 and sit at the end of its
// context: new token j has position context_lens[i] - q_len + j and sees positions 0..itself.
//
// Grid: (ceil(max_q_len / BLOCK_Q), num_seqs, num_q_heads); blocks past a sequence's length exit.
// Block: BLOCK_Q * TPR threads; TPR = HEAD_DIM / 64 threads share one query row, each owning 64
// of its dims (interleaved in 8-dim chunks so the threads of a row hit different smem banks).
// Each thread keeps its q, output accumulator and one K tile of scores in registers; K/V tiles of
// BLOCK_K tokens are staged in shared memory and read as broadcasts.
//
#include <math_constants.h>
#include "common.cuh"

namespace {

constexpr int BLOCK_Q = 64;
constexpr int BLOCK_K = 32;

template <int HEAD_DIM>
__device__ __forceinline__ void prefill_attention(
    bf16* __restrict__ out, const bf16* __restrict__ q, int q_row_stride,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ block_table_width,
    const int* __restrict__ query_start, const int* __restrict__ context_lens, int block_size,
    int num_kv_heads, int group, float scale) {
    constexpr int TPR = HEAD_DIM / 64;           // threads per query row
    constexpr int CHUNKS = 64 / 8;               // 8-dim chunks each thread owns
    constexpr int ROW_CHUNKS = HEAD_DIM / 8;
    __shared__ __align__(16) bf16 k_tile[BLOCK_K][HEAD_DIM];
    __shared__ __align__(16) bf16 v_tile[BLOCK_K][HEAD_DIM];

    const int seq = blockIdx.y, head = blockIdx.z, kv_head = head / group;
    const int num_q_heads = num_kv_heads * group;
    const int q_begin = query_start[seq];
    const int q_len = query_start[seq + 1] - q_begin;
    const int tile_q0 = blockIdx.x * BLOCK_Q;
    if (tile_q0 >= q_len) return;  // uniform across the block
    const int ctx = context_lens[seq];
    const int first_pos = ctx - q_len;
    const int row = threadIdx.x / TPR, part = threadIdx.x % TPR;
    const int qi = tile_q0 + row;
    const bool active = qi < q_len;
    const int pos_q = first_pos + qi;
    const int kv_end = first_pos + min(tile_q0 + BLOCK_Q, q_len);  // one past the tile's last position
    // the row stride is read from device memory so a captured CUDA graph serves any width
    const int* table = block_tables + (size_t)seq * *block_table_width;
    const size_t kv_row = (size_t)num_kv_heads * HEAD_DIM;

    float q_reg[64], o[64];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int d0 = (c * TPR + part) * 8;
        if (active) {
            load_bf16x8(q + (size_t)(q_begin + qi) * q_row_stride + head * HEAD_DIM + d0, &q_reg[c * 8]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) q_reg[c * 8 + i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q_reg[c * 8 + i] *= scale;
            o[c * 8 + i] = 0.0f;
        }
    }
    float m = -CUDART_INF_F, l = 0.0f;

    for (int k0 = 0; k0 < kv_end; k0 += BLOCK_K) {
        __syncthreads();  // the previous tile is no longer read
        for (int c = threadIdx.x; c < BLOCK_K * ROW_CHUNKS; c += blockDim.x) {
            const int r = c / ROW_CHUNKS, d0 = (c % ROW_CHUNKS) * 8;
            const int pos = k0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (pos < kv_end) {
                const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
                const size_t off = slot * kv_row + kv_head * HEAD_DIM + d0;
                kv = *reinterpret_cast<const uint4*>(k_cache + off);
                vv = *reinterpret_cast<const uint4*>(v_cache + off);
            }
            *reinterpret_cast<uint4*>(&k_tile[r][d0]) = kv;
            *reinterpret_cast<uint4*>(&v_tile[r][d0]) = vv;
        }
        __syncthreads();

        float s[BLOCK_K];
        float tile_max = m;
#pragma unroll
        for (int j = 0; j < BLOCK_K; ++j) {
            float dot = 0.0f;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                float k[8];
                load_bf16x8(&k_tile[j][(c * TPR + part) * 8], k);
#pragma unroll
                for (int i = 0; i < 8; ++i) dot += q_reg[c * 8 + i] * k[i];
            }
            if (TPR == 2) dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            s[j] = (k0 + j <= pos_q && k0 + j < kv_end) ? dot : -CUDART_INF_F;
            tile_max = fmaxf(tile_max, s[j]);
        }
        // Rows with every key masked so far (only inactive padding rows) keep m = -inf.
        const float alpha = tile_max == -CUDART_INF_F ? 1.0f : __expf(m - tile_max);
        l *= alpha;
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= alpha;
#pragma unroll
        for (int j = 0; j < BLOCK_K; ++j) {
            const float p = s[j] == -CUDART_INF_F ? 0.0f : __expf(s[j] - tile_max);
            l += p;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                float v[8];
                load_bf16x8(&v_tile[j][(c * TPR + part) * 8], v);
#pragma unroll
                for (int i = 0; i < 8; ++i) o[c * 8 + i] += p * v[i];
            }
        }
        m = tile_max;
    }

    if (!active) return;
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
    bf16* dst = out + (size_t)(q_begin + qi) * num_q_heads * HEAD_DIM + head * HEAD_DIM;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        float r[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = o[c * 8 + i] * inv_l;
        store_bf16x8(dst + (c * TPR + part) * 8, r);
    }
}

}  // namespace

#define PREFILL_ATTENTION_KERNEL(D)                                                              \
    extern "C" __global__ void __launch_bounds__(BLOCK_Q*(D / 64)) attention_prefill_simt_d##D(       \
        bf16* out, const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, const int* block_table_width, const int* query_start,                 \
        const int* context_lens, int block_size, int num_kv_heads, int group, float scale) {     \
        prefill_attention<D>(out, q, q_row_stride, k_cache, v_cache, block_tables,               \
                             block_table_width, query_start, context_lens, block_size,           \
                             num_kv_heads, group, scale);                                        \
    }
PREFILL_ATTENTION_KERNEL(64)
PREFILL_ATTENTION_KERNEL(128)
