// RMSNorm: out[r] = in[src(r)] / sqrt(mean(in[src(r)]^2) + eps) * weight, fp32 math, bf16 storage.
// `rows` (may be null) maps output row r to input row src(r): the final norm reads only each
// sequence's last token, so the LM head never sees the other prompt rows.
// The sum of squares: chunk sums of SS_CHUNK = 16 columns (common.cuh's chunk_sum_sq, the tree the
// embedding's handed-over norm uses too) in shared memory, added in sum_of_chunk_sums' order.
// Launch: one block per output row, THREADS threads, 16-byte loads. Requires hidden % 8 == 0 and
// hidden <= MAX_HIDDEN (gpu/ops/rowwise.py checks both).
// `in` is the previous kernel's output: no __restrict__, so its loads are never the read-only
// (.nc) kind that ptxas may move above wait_for_producer() (see common.cuh).
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

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm(bf16* __restrict__ out, const bf16* in,
                                    const bf16* __restrict__ weight, const int* __restrict__ rows,
                                    int num_rows, int hidden, float eps) {
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
        for (int i = 0; i < 8; ++i) v[i] = norm_apply(v[i], scale, w[i]);
        store_bf16x8(out + (size_t)r * hidden + c, v);
    }
}
