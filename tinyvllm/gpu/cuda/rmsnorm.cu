// RMSNorm: out[r] = in[src(r)] / sqrt(mean(in[src(r)]^2) + eps) * weight, fp32 math, bf16 storage.
// `rows` (may be null) maps output row r to input row src(r): the final norm reads only each
// sequence's last token, so the LM head never sees the other prompt rows.
// The sum of squares is common.cuh's: chunk sums of 16 columns (chunk_sum_sq) in shared memory,
// added in sum_of_chunk_sums' order.
// Launch: one block per output row, THREADS threads, 16-byte loads. Requires hidden % 8 == 0 and
// hidden <= MAX_HIDDEN (gpu/ops.py checks both).
// `in` is the previous kernel's output: no __restrict__, so its loads are never the read-only
// (.nc) kind that ptxas may move above wait_for_producer() (see common.cuh).
#include "common.cuh"

constexpr int THREADS = 256;   // block size (gpu/ops.py launches with it)
constexpr int MAX_HIDDEN = 32768;   // the chunk sums of one row sit in shared memory (8 KB)

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm(bf16* __restrict__ out, const bf16* in,
                                    const bf16* __restrict__ weight, const int* __restrict__ rows,
                                    int num_rows, int hidden, float eps) {
    __shared__ float chunk_ss[MAX_HIDDEN / SS_CHUNK];
    __shared__ float inv_rms;
    wait_for_producer();
    allow_consumer();
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
