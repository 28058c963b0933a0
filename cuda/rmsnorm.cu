// RMSNorm: out[r] = in[src(r)] / sqrt(mean(in[src(r)]^2) + eps) * weight, fp32 math, bf16 storage.
// `rows` (may be null) maps output row r to input row src(r): the final norm reads only each
// sequence's last token, so the LM head never sees the other prompt rows.
// The sum of squares: chunk sums of SS_CHUNK = 16 columns (common.cuh's chunk_sum_sq, the tree the
// embedding's handed-over norm uses too) in shared memory, added in sum_of_chunk_sums' order.
// Launch: one block per output row, THREADS threads, 16-byte loads. Requires hidden % 8 == 0 and
// hidden <= MAX_HIDDEN (gpu/ops/rowwise.py checks both).
// `in` is the previous kernel's output: no __restrict__, so its loads are never the read-only
// (.nc) kind that ptxas may move above wait_for_producer() (see common.cuh).
//
// Kernels:
//   rms_norm                the norm as above (Llama, Mistral, Qwen).
//   rms_norm_offset         times (weight_offset + weight), the sum in fp32: Gemma 3's x * (1 + w)
//                           (reference/kernels.py's rms_norm(weight_offset=)).
//   rms_norm_residual_add   Gemma 3's norms of the attention and MLP outputs, added into the
//                           residual stream: hidden[r] = bf16(hidden[r] + bf16(RMSNorm(x[r]) *
//                           (weight_offset + w))); with next_weight non-null it also hands the norm
//                           after it over, as gemv.cu's gemv_residual_norm does (normed =
//                           bf16(hidden * (weight_offset + next_weight)), row_ss = each 16
//                           columns' sum of squares of the new hidden), for the prenormed GEMV
//                           that follows (the fused decode layer, gpu/model.py). Requires
//                           hidden % 16 == 0.
#include "common.cuh"

// A row's sum of squares from its chunk sums p[0..chunks): lane l adds p[l], p[l + 32], ... in
// order, then the lanes' sums meet in warp_sum's butterfly. Every lane gets the total. All 32
// lanes call it.
__device__ __forceinline__ float sum_of_chunk_sums(const float* p, int chunks, int lane) {
    float s = 0.0f;
    for (int c = lane; c < chunks; c += 32) s = __fadd_rn(s, p[c]);
    return warp_sum(s);
}

constexpr int THREADS = 256;   // block size (gpu/ops/rowwise.py launches with it)
constexpr int MAX_HIDDEN = 32768;   // the chunk sums of one row sit in shared memory (8 KB)

template <bool OFFSET>
__device__ __forceinline__ void rms_norm_body(bf16* __restrict__ out, const bf16* in, const bf16* __restrict__ weight,
                                              const int* __restrict__ rows, int num_rows, int hidden, float eps,
                                              float weight_offset) {
    __shared__ float chunk_ss[MAX_HIDDEN / SS_CHUNK];
    __shared__ float inv_rms;
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const bf16* x = in + (size_t)(rows ? rows[r] : r) * hidden;
    const int chunks = (hidden + SS_CHUNK - 1) / SS_CHUNK;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[SS_CHUNK];
        unpack_bf16x8(load_fresh(x + c * SS_CHUNK), v);
        if (c * SS_CHUNK + 8 < hidden) unpack_bf16x8(load_fresh(x + c * SS_CHUNK + 8), v + 8);
        else for (int i = 8; i < SS_CHUNK; ++i) v[i] = 0.0f;
        chunk_ss[c] = chunk_sum_sq(v);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const float total = sum_of_chunk_sums(chunk_ss, chunks, threadIdx.x);
        if (threadIdx.x == 0) inv_rms = norm_inv_rms(total, hidden, eps);
    }
    __syncthreads();
    const float scale = inv_rms;
    float v[8], w[8];
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {  // second read hits L1/L2
        unpack_bf16x8(load_fresh(x + c), v);
        load_bf16x8(weight + c, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = norm_apply(v[i], scale, OFFSET ? __fadd_rn(w[i], weight_offset) : w[i]);
        store_bf16x8(out + (size_t)r * hidden + c, v);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm(bf16* __restrict__ out, const bf16* in,
                                    const bf16* __restrict__ weight, const int* __restrict__ rows,
                                    int num_rows, int hidden, float eps) {
    rms_norm_body<false>(out, in, weight, rows, num_rows, hidden, eps, 0.0f);
}

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_offset(bf16* __restrict__ out, const bf16* in,
                                    const bf16* __restrict__ weight, const int* __restrict__ rows,
                                    int num_rows, int hidden, float eps, float weight_offset) {
    rms_norm_body<true>(out, in, weight, rows, num_rows, hidden, eps, weight_offset);
}

// hidden, x: [num_rows, hidden_size] (hidden read and written: the residual stream; x: the o or
// down projection's output). next_weight (null: no hand-over), normed [num_rows, hidden_size] and
// row_ss [num_rows][hidden_size / 16]: the next norm handed over.
extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_residual_add(
    bf16* hidden, const bf16* x, const bf16* __restrict__ weight, int num_rows, int hidden_size, float eps,
    float weight_offset, const bf16* __restrict__ next_weight, bf16* __restrict__ normed, float* __restrict__ row_ss) {
    __shared__ float chunk_ss[MAX_HIDDEN / SS_CHUNK];
    __shared__ float inv_rms;
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const int chunks = hidden_size / SS_CHUNK;   // the sum of squares of x's row, as rms_norm's
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[SS_CHUNK];
        unpack_bf16x8(load_fresh(x + (size_t)r * hidden_size + c * SS_CHUNK), v);
        unpack_bf16x8(load_fresh(x + (size_t)r * hidden_size + c * SS_CHUNK + 8), v + 8);
        chunk_ss[c] = chunk_sum_sq(v);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const float total = sum_of_chunk_sums(chunk_ss, chunks, threadIdx.x);
        if (threadIdx.x == 0) inv_rms = norm_inv_rms(total, hidden_size, eps);
    }
    __syncthreads();
    const float scale = inv_rms;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const size_t at = (size_t)r * hidden_size + c * SS_CHUNK;
        float v[SS_CHUNK], h[SS_CHUNK], w[SS_CHUNK];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            unpack_bf16x8(load_fresh(x + at + 8 * half), v + 8 * half);
            unpack_bf16x8(load_fresh(hidden + at + 8 * half), h + 8 * half);
            load_bf16x8(weight + c * SS_CHUNK + 8 * half, w + 8 * half);
        }
#pragma unroll
        for (int i = 0; i < SS_CHUNK; ++i)   // the norm's output rounded to bf16, then the add, rounded
            h[i] = bf16_round(__fadd_rn(h[i], bf16_round(norm_apply(v[i], scale, __fadd_rn(w[i], weight_offset)))));
        store_bf16x8(hidden + at, h);
        store_bf16x8(hidden + at + 8, h + 8);
        if (next_weight)   // the next norm's operand and this chunk's sum of squares (embedding.cu's form)
            hand_over_norm_chunk(h, next_weight + c * SS_CHUNK, weight_offset, normed + at, &row_ss[(size_t)r * chunks + c]);
    }
}
