// RMSNorm: out[r] = in[src(r)] / sqrt(mean(in[src(r)]^2) + eps) * weight, fp32 math, bf16 storage.
// `rows` (may be null) maps output row r to input row src(r): the final norm reads only each
// sequence's last token, so the LM head never sees the other prompt rows.
// Launch: one block per output row, THREADS threads, 16-byte loads. Requires hidden % 8 == 0.
// `in` is the previous kernel's output: no __restrict__, so its loads are never the read-only
// (.nc) kind that ptxas may move above wait_for_producer() (see common.cuh).
#include "common.cuh"

constexpr int THREADS = 256;   // block size (gpu/ops.py launches with it)
static_assert(THREADS == NORM_THREADS, "norm_partial_sum's order assumes one thread per NORM_THREADS lane");

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm(bf16* __restrict__ out, const bf16* in,
                                    const bf16* __restrict__ weight, const int* __restrict__ rows,
                                    int num_rows, int hidden, float eps) {
    wait_for_producer();
    allow_consumer();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const bf16* x = in + (size_t)(rows ? rows[r] : r) * hidden;
    // common.cuh's norm_* helpers: the fused GEMV (gemv.cu) recomputes this norm bit for bit
    const float scale = norm_inv_rms(block_sum(norm_partial_sum(x, hidden, threadIdx.x)), hidden, eps);
    float v[8], w[8];
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {  // second read hits L1/L2
        unpack_bf16x8(load_fresh(x + c), v);
        load_bf16x8(weight + c, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = norm_apply(v[i], scale, w[i]);
        store_bf16x8(out + (size_t)r * hidden + c, v);
    }
}
