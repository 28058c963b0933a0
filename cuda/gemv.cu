// Small-batch bf16 GEMV / skinny GEMM for decode:  Y[m, n] (+)= X[m, k] @ W[n, k]^T,  1 <= m <= 8.
//
// Decode at batch <= 8 reads every weight once per step and does almost no math, so this kernel
// is a weight stream: each byte of W is copied exactly once, 16 bytes per lane per copy, several
// steps in flight per warp, from HBM through L2 only (cp.async.cg). X (at most 8 x 8192 bf16 =
// 128 KB) is re-read by every CTA and is served by L2.
//
// The math runs on the tensor cores: one mma.sync.m16n8k16 (bf16 in, fp32 accumulate) per 8 W
// values per lane instead of 8*m scalar FMAs plus conversions. Per warp step:
//   A (16 x 16) = W rows n0 .. n0 + 15,  B (16 x 8) = X^T (column j = X row j; rows >= m zero),
//   D (16 x 8)  = Y^T tile: D[r][j] += sum_k W[n0 + r][k] X[j][k].
// A dot product may visit k in any order as long as A and B agree, so instead of the canonical
// fragment layout the lanes load contiguous memory: lane (g = lane/4, t = lane%4) reads the 16
// bytes k = k0 + 8t .. k0 + 8t + 7 of W rows n0 + g and n0 + 8 + g and of X row g. Those are
// uint4 p (row g), q (row g + 8), v (X); each 32-bit word is a bf16 pair. Two mmas consume them:
//   mma 1: A = {p.x, q.x, p.y, q.y}, B = {v.x, v.y};   mma 2: A = {p.z, q.z, p.w, q.w}, B = {v.z, v.w}.
// In the PTX fragment layout, A's registers 0/1 and B's register 0 hold logical k = 2t, 2t+1,
// A's registers 2/3 and B's register 1 hold logical k = 2t+8, 2t+9 (rows g and g+8 of A, column
// g of B). So a logical k maps to the same physical k (k0 + 8t + 0/1 or + 2/3, resp. + 4..7 in
// mma 2) in A and in B, for every lane with the same t: each mma sums matching products only.
// A warp step thus covers 16 W rows x 32 k (a 64-byte run of each row) with 2 W copies, 1 X copy
// and 2 mmas; D's c0..c3 land on lane (g, t) as Y[2t][n0+g], Y[2t+1][n0+g], Y[2t][n0+8+g],
// Y[2t+1][n0+8+g].
//
// Launch shape (tinyvllm/gpu/ops/gemv.py picks it):
//   grid.x  = ceil(n / 16): a CTA owns the 16 outputs n0 .. n0 + 15 of every x row (one mma tile).
//   block.x = 32 * kw, kw in 1..32 warps that split K (split-K inside the CTA). The K range is
//             cut into 32-wide steps; warp w walks steps [w*S/kw, (w+1)*S/kw), S = ceil(k/32).
//   shared  = kw * (512 + RING_BYTES_PER_WARP) bytes: each warp's 8 x 16 fp32 partial tile and its
//             ring (below); the prenormed kernels add the producer's row sums. After one
//             __syncthreads the first 16*m threads sum the kw partials of one output each.
// __launch_bounds__(1024) caps the kernel at 64 registers, so 32 warps fit on an SM whatever kw
// is (ptxas, nvcc 13.0 sm_90: 40-48 registers, no spills; gemv_prenormed_rope_kv keeps a 32-byte
// stack frame for sincosf's slow path).
// The weight ring: each warp streams through its own ring of RING_STEPS slots in shared memory,
// one cp.async.cg commit group per step. Slot i % RING_STEPS holds step i's W rows g and g + 8
// and X row g (16 bytes per lane each); right after step i's mmas the warp refills the slot with
// step i + RING_STEPS, so RING_STEPS steps stay in flight without a gap. The first RING_STEPS
// steps' W is copied before griddepcontrol.wait (the weights are written by no kernel), their X
// after it, with every address computed before the wait (gemv_body's prologue says why). Shared
// memory grows by kw * RING_BYTES_PER_WARP (6,400 bytes): a wave of 32 warps per SM takes 221,184
// bytes of the SM's 233,472. Against W loaded into registers a few steps at a time (the warp's
// bytes in flight falling to zero at every turn), the ring measured 0.825 ms against 1.027 on the
// Llama-1B decode graph, every kernel triggering its dependents first (H200, 2026-12-04, b1f78de).
// The Python side chooses kw so that ceil(n/16) * kw fills the GPU about once (o/qkv: 16 warps of
// 4 steps, down: 32 warps of 8 steps, gate_up: 4 warps of 16 steps): small matrices put their
// whole weight in flight at once, big ones stream with fewer, longer warps. No workspace, one
// launch, no atomics (but the LM head's argmax keys, below): every output is written by exactly
// one thread.
//
// Bounds: W rows >= n, k >= K (k % 8 == 0 is required, so a 16-byte chunk is all in or all out)
// and X rows >= m are never read (zero-filled copies in their place); outputs outside [m, n) are
// never written. x and w must be 16-byte aligned. The loop trip count and the mma are
// warp-uniform (they depend on the warp index only), as mma.sync requires.
// PDL-ready: the kernel executes griddepcontrol.wait after issuing its first W copies and before
// it touches X or Y. That is a no-op for an ordinary launch; under programmatic dependent launch
// the weight stream starts while the previous kernel (which produces X) is still finishing.
// It calls allow_consumer() first thing, so the next kernel can be resident before this one ends.
//
// These entry points share this body (its epilogue and the mma pair live in gemv_common.cuh, which
// the quantized GEMV, gemv_quant.cu, shares); they differ in how X is loaded and how Y is stored:
//   gemv_bf16                 X as stored; Y stored (or added: the residual add). linear() at
//                             decode batches: the nine-launch layer's projections and LM head.
//   gemv_residual_norm        y += x @ W^T (o or down into the residual stream), and the RMSNorm
//                             after it handed over: bf16(y * its gain) and per-CTA sums of y^2 per row.
//   gemv_prenormed_rope_kv    the qkv projection on that handed-over operand, its epilogue applying
//                             RoPE to q and k and writing k and v to the paged cache (rope_write_kv
//                             inside); its _bias twin adds Qwen2's q/k/v biases first
//                             (rope_write_kv_bias inside). Families with q/k norms (Qwen3, Gemma 3)
//                             take gemv_prenormed_bf16 then rope_write_kv_qk_norm instead: the norm
//                             needs a whole head, and a CTA holds 16 of its rows.
//   gemv_prenormed_silu_mul   the gate_up projection on the handed-over operand, its epilogue
//                             storing silu(gate) * up (silu_mul inside); gemv_prenormed_gelu_mul
//                             stores gelu_tanh(gate) * up (Gemma 3's GeGLU: gelu_tanh_mul inside).
//   gemv_prenormed_bf16       Y = inv_rms * (X @ W^T) on the handed-over operand, stored: the LM
//                             head after the final norm, which the last down hands over; it may
//                             also keep each row's greedy argmax key (head_argmax).
// The handed-over norm: an RMSNorm's scale inv_rms is one number per x row, so it comes out of
// the dot product:
//   Y[j, n] = inv_rms[j] * sum_k W[n, k] * bf16(x[j, k] * norm_w[k]),
//   inv_rms[j] = 1 / sqrt(mean_k x[j, k]^2 + eps).
// The residual GEMV before the norm (or, for the first layer, the embedding gather) holds the new
// residual rows x in its epilogue, so it writes the operand bf16(x * norm_w) and each CTA's sum of
// squares of its 16 columns; the prenormed GEMV copies the m x k/16 row sums into shared memory
// with its first X chunks and multiplies each output's fp32 sum by its row's inv_rms before it
// stores / rotates / applies silu. The bits differ from rms_norm then gemv (the operand is
// bf16(x * norm_w), not bf16(x * inv_rms * norm_w), and inv_rms is applied in fp32 after the
// sum): reference/kernels.py's rms_norm_linear is this formula, and tests/test_reference_fused.py
// bounds its distance from RMSNorm-then-linear.
// An epilogue that combines two outputs needs both in one CTA, so the fused modes pick the
// CTA's 16 W rows as two runs of 8 that belong together (cta_tile below): gate rows j..j+7 with
// up rows I+j..I+j+7, or head-dim rows i..i+7 of one head with their RoPE partners i+D/2..;
// partners then sit 8 lanes apart in the epilogue (one shuffle). The epilogues use common.cuh's
// RoPE and SwiGLU arithmetic, the same as rope_kv.cu's and activation.cu's.
// Every W copy carries the .L2::256B prefetch hint (common.cuh's ring_copy): each 64-byte run asks
// L2 for the whole 256-byte sector group it lies in, which the lane's next steps read. In the
// Llama-1B decode graph 0.823 ms with it on every copy against 0.830 with it only where a warp
// walks 16 steps or more (H200, 2026-12-04, b1f78de).
#include "common.cuh"

namespace {

constexpr int ROWS_PER_CTA = 16;   // W rows (outputs n) per CTA: the M of one m16n8k16 tile
constexpr int STEP_K = 32;        // k per warp step: 4 lanes x 8 bf16 per W row
constexpr int MAX_K_WARPS = 32;
constexpr int RING_STEPS = 4;     // steps per warp in flight (cp.async groups)
// one step of one warp: W rows g and g + 8, X row g (16 bytes per lane each), and 4 quads that
// nothing uses: slots 1,600 bytes apart rather than 1,536 measured 0.937 -> 0.929 ms a token on
// Llama-1B (bench --workload latency, H100, 2026-12-07, alternating in one run)
constexpr int RING_SLOT_QUADS = 3 * 32 + 4;
constexpr int RING_BYTES_PER_WARP = RING_STEPS * RING_SLOT_QUADS * 16;   // gpu/ops/gemv.py sizes shared memory by it
}  // namespace

#include "gemv_common.cuh"   // mma_pair, the X load modes and the epilogues (shared with gemv_quant.cu)

namespace {

// y: per EPI (store: [m, n] bf16 or fp32 (out_f32), row stride n; rope_kv: the qkv rows [m, n];
// silu_mul, gelu_mul: act [m, n/2]); w: [n, k] bf16; x: [m, k] bf16 (prenormed: the handed-over operand).
// accumulate = 1 (store): y += x @ w^T (fp32 sum of the old value and the product, rounded once).
// QKV_BIAS (rope_kv): each product rounded to bf16 gets its bias rope.bias[n] added, rounded again
// (rope_kv.cu's rope_write_kv_bias adds it to the stored product the same way).
template <XLoad MODE, Epilogue EPI, bool QKV_BIAS = false>
__device__ __forceinline__ void gemv_body(void* __restrict__ y, const bf16* __restrict__ x,
                                          const NormArgs& norm, const bf16* __restrict__ w,
                                          int m, int n, int k, int out_f32, int accumulate,
                                          const RopeArgs& rope, const NormOut& norm_out,
                                          unsigned long long* head_argmax = nullptr) {
    extern __shared__ float partial[];   // [warps][8 rows of x][16 columns of the CTA], then the
                                         // warps' ring slots, then (prenormed) [m][ss_count]
                                         // producer sums of squares
    allow_consumer();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const Tile w_tile = cta_tile<EPI>(blockIdx.x, n, rope.head_dim);
    const int steps = (k + STEP_K - 1) / STEP_K;
    // k < 2^26 (checked in Python), so steps * warps < 2^26 fits an int.
    const int s_begin = warp * steps / warps, s_end = (warp + 1) * steps / warps;

    // This lane's two W rows (row_a + g, row_b + g) and its X row g; pointers of rows that do not
    // exist are clamped to row 0 and never dereferenced.
    const bool w_ok0 = w_tile.row_a + g < n, w_ok1 = w_tile.row_b + g < n, x_ok = g < m;
    const bf16* w0 = w + (size_t)(w_ok0 ? w_tile.row_a + g : 0) * k + 8 * t;
    const bf16* w1 = w + (size_t)(w_ok1 ? w_tile.row_b + g : 0) * k + 8 * t;
    const bf16* xr = x + (x_ok ? g : 0) * (size_t)k + 8 * t;
    hold(w0), hold(w1), hold(xr);

    // prenormed: the producer's m x ss_count sums of squares, copied into shared memory right
    // after the wait in the same cp.async group as the first X chunks, so the epilogue's inv_rms
    // costs no memory round trip at the end. ss_count % 4 == 0 (k % 64 == 0, checked in Python):
    // whole 16-byte chunks, shared among all the CTA's lanes.
    const int ss_count = (k + ROWS_PER_CTA - 1) / ROWS_PER_CTA;
    float* const producer_ss = partial + warps * (8 * ROWS_PER_CTA) + warps * (RING_BYTES_PER_WARP / 4);
    auto copy_producer_ss = [&]() {
        if constexpr (MODE == XLoad::prenormed) {
            for (int c = threadIdx.x; c < m * ss_count / 4; c += blockDim.x)
                cp_async16(smem_addr(producer_ss + 4 * c), norm.row_ss + 4 * c, 16);
        }
    };

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // The ring (header): this warp's RING_STEPS slots sit after the partial tiles. Step i of the
    // warp (s_begin + i) lives in slot i % RING_STEPS: W row g at quad lane, W row g + 8 at
    // 32 + lane, X row g at 64 + lane. Each lane reads back only the pieces it copied itself, so
    // they need no barrier: its own cp_async_wait makes them visible to it. A slot is refilled
    // only after the step's mma, which every lane of the warp executes together
    // (mma.sync.aligned) with the values read from it.
    uint4* const slots = reinterpret_cast<uint4*>(partial + warps * (8 * ROWS_PER_CTA)) +
                         warp * (RING_BYTES_PER_WARP / 16);
    const int my_steps = s_end - s_begin;
    auto copy_w = [&](int i) {   // weights: written by no kernel
        uint4* slot = slots + (i % RING_STEPS) * RING_SLOT_QUADS;
        const int kk = (s_begin + i) * STEP_K;
        const bool in = kk + 8 * t < k;
        ring_copy(slot + lane, in && w_ok0 ? w0 + kk : w0, in && w_ok0 ? 16 : 0);
        ring_copy(slot + 32 + lane, in && w_ok1 ? w1 + kk : w1, in && w_ok1 ? 16 : 0);
    };
    auto copy_x = [&](int i) {
        uint4* slot = slots + (i % RING_STEPS) * RING_SLOT_QUADS;
        const int kk = (s_begin + i) * STEP_K;
        const bool in = x_ok && kk + 8 * t < k;
        cp_async16(smem_addr(slot + 64 + lane), in ? xr + kk : xr, in ? 16 : 0);
    };
    // W of the first RING_STEPS steps before the wait (one group each), X after it (one
    // group); the loop then commits one group per step, empty near the end, so that at step
    // i >= RING_STEPS exactly RING_STEPS - 1 groups were committed after the one holding it.
#pragma unroll
    for (int i = 0; i < RING_STEPS; ++i) {
        if (i < my_steps) copy_w(i);
        cp_async_commit();
    }
    const void* x_src[RING_STEPS];
    int x_bytes[RING_STEPS];
    first_x_sources(xr, x_ok, my_steps, 8 * t, k, [&](int i) { return (s_begin + i) * STEP_K; }, x_src, x_bytes);
    wait_for_producer();   // X is the previous kernel's output
#pragma unroll
    for (int i = 0; i < RING_STEPS; ++i)
        cp_async16(smem_addr(slots + i * RING_SLOT_QUADS + 64 + lane), x_src[i], x_bytes[i]);
    copy_producer_ss();    // in X's group: done by its wait below
    cp_async_commit();
    cp_async_wait<0>();
    for (int i = 0; i < my_steps; ++i) {
        if (i >= RING_STEPS) cp_async_wait<RING_STEPS - 1>();
        const uint4* slot = slots + (i % RING_STEPS) * RING_SLOT_QUADS;
        const uint4 p = slot[lane], q = slot[32 + lane], v = slot[64 + lane];
        mma_pair(acc, p, q, v);
        if (i + RING_STEPS < my_steps) {
            copy_w(i + RING_STEPS);
            copy_x(i + RING_STEPS);
        }
        cp_async_commit();
    }
    if constexpr (MODE == XLoad::prenormed) cp_async_wait<0>();   // visible to all after __syncthreads

    // Lane (g, t) holds tile columns g and 8 + g of x rows 2t and 2t+1 (this warp's share of K);
    // partial[warp][row][column].
    float* mine = partial + warp * (8 * ROWS_PER_CTA) + 2 * t * ROWS_PER_CTA + g;
    mine[0] = acc[0];
    mine[ROWS_PER_CTA] = acc[1];
    mine[8] = acc[2];
    mine[ROWS_PER_CTA + 8] = acc[3];
    __syncthreads();

    gemv_epilogue<MODE, EPI, QKV_BIAS>(partial, warps, y, m, n, k, out_f32, accumulate, norm.eps, producer_ss,
                                       ss_count, rope, norm_out, head_argmax);
}

}  // namespace

// Y (+)= X @ W^T. y: [m, n] bf16 (out_f32 = 0) or fp32 (out_f32 = 1); x: [m, k]; w: [n, k].
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_bf16(void* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w,
          int m, int n, int k, int out_f32, int accumulate) {
    gemv_body<XLoad::plain, Epilogue::store>(y, x, NormArgs{}, w, m, n, k, out_f32, accumulate, RopeArgs{}, NormOut{});
}

// The handed-over norm (header): y += x @ W^T as gemv_bf16 with accumulate = 1 (the o or down
// projection adding into the residual stream y [m, n]), and for the RMSNorm that follows it
// normed = bf16(y * norm_w) [m, n] and row_ss[j][cta] = the sum of this CTA's 16 new y[j]^2.
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_residual_norm_bf16(bf16* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w,
                        int m, int n, int k, const bf16* __restrict__ norm_w, bf16* __restrict__ normed,
                        float* __restrict__ row_ss) {
    gemv_body<XLoad::plain, Epilogue::residual_norm>(y, x, NormArgs{}, w, m, n, k, 0, 1, RopeArgs{},
                                                     NormOut{norm_w, normed, row_ss});
}

// qkv = inv_rms * (x @ W^T) on x = normed from gemv_residual_norm_bf16 (or the embedding gather),
// inv_rms = 1 / sqrt(sum(row_ss[j]) / k + eps), then RoPE on its q and k heads (q rotated in
// place; k rotated into k_cache, v into v_cache at slot_mapping): rope_write_kv inside.
// row_ss: [m][k / 16], k % 64 == 0. Shared memory: m * k / 16 * 4 bytes more than gemv_bf16's.
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_prenormed_rope_kv_bf16(bf16* __restrict__ qkv, const bf16* __restrict__ x, const float* __restrict__ row_ss,
                            const bf16* __restrict__ w, int m, int n, int k, float eps,
                            bf16* k_cache, bf16* v_cache, const int* __restrict__ positions,
                            const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq,
                            int num_q_heads, int num_kv_heads, int head_dim) {
    gemv_body<XLoad::prenormed, Epilogue::rope_kv>(
        qkv, x, NormArgs{eps, row_ss}, w, m, n, k, 0, 0,
        RopeArgs{k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim, nullptr},
        NormOut{});
}

// gemv_prenormed_rope_kv_bf16 with the q/k/v projection's biases (Qwen2): bias [n] added to each
// product rounded to bf16, the sum rounded again, before RoPE and the cache write.
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_prenormed_rope_kv_bias_bf16(bf16* __restrict__ qkv, const bf16* __restrict__ x, const float* __restrict__ row_ss,
                                 const bf16* __restrict__ w, int m, int n, int k, float eps,
                                 bf16* k_cache, bf16* v_cache, const int* __restrict__ positions,
                                 const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq,
                                 int num_q_heads, int num_kv_heads, int head_dim, const bf16* __restrict__ bias) {
    gemv_body<XLoad::prenormed, Epilogue::rope_kv, true>(
        qkv, x, NormArgs{eps, row_ss}, w, m, n, k, 0, 0,
        RopeArgs{k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim, bias},
        NormOut{});
}

// Y = inv_rms * (x @ W^T) on a prenormed x, as gemv_prenormed_rope_kv_bf16, stored as gemv_bf16
// stores it (bf16 or fp32, out_f32): the decode step's LM head, its final norm handed over by the
// last layer's down GEMV (gpu/model.py). y: [m, n]; row_ss: [m][k / 16], k % 64 == 0.
// head_argmax (non-null with out_f32 = 1): [m] keys that must start at 0 (the step's embedding
// clears them); each CTA folds its 16 logits per row in with one atomicMax of the largest
// argmax_key (common.cuh), so when the kernel ends every row's key names its greedy token and the
// sampler need not read the logits for it (sampling.cu's head_argmax).
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_prenormed_bf16(void* __restrict__ y, const bf16* __restrict__ x, const float* __restrict__ row_ss,
                    const bf16* __restrict__ w, int m, int n, int k, float eps, int out_f32,
                    unsigned long long* __restrict__ head_argmax) {
    gemv_body<XLoad::prenormed, Epilogue::store>(y, x, NormArgs{eps, row_ss}, w, m, n, k, out_f32, 0,
                                                 RopeArgs{}, NormOut{}, head_argmax);
}

// act = silu(gate) * up of gate_up = inv_rms * (x @ W^T) on a prenormed x, as
// gemv_prenormed_rope_kv_bf16; W = [gate; up] ([n, k], gate rows first), act: [m, n/2].
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_prenormed_silu_mul_bf16(bf16* __restrict__ act, const bf16* __restrict__ x, const float* __restrict__ row_ss,
                             const bf16* __restrict__ w, int m, int n, int k, float eps) {
    gemv_body<XLoad::prenormed, Epilogue::silu_mul>(act, x, NormArgs{eps, row_ss}, w, m, n, k, 0, 0,
                                                    RopeArgs{}, NormOut{});
}

// act = gelu_tanh(gate) * up of gate_up = inv_rms * (x @ W^T) on a prenormed x, as
// gemv_prenormed_silu_mul_bf16 (Gemma 3's GeGLU).
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_prenormed_gelu_mul_bf16(bf16* __restrict__ act, const bf16* __restrict__ x, const float* __restrict__ row_ss,
                             const bf16* __restrict__ w, int m, int n, int k, float eps) {
    gemv_body<XLoad::prenormed, Epilogue::gelu_mul>(act, x, NormArgs{eps, row_ss}, w, m, n, k, 0, 0,
                                                    RopeArgs{}, NormOut{});
}
