// Small-batch bf16 GEMV / skinny GEMM for decode:  Y[m, n] (+)= X[m, k] @ W[n, k]^T,  1 <= m <= 8.
//
// Decode at batch <= 8 reads every weight once per step and does almost no math, so this kernel
// is a weight stream: each byte of W is loaded exactly once, 16 bytes per lane per load, several
// loads in flight per lane, straight from HBM past L1 (ld.global.nc.L1::no_allocate). X (at most
// 8 x 8192 bf16 = 128 KB) is re-read by every CTA and is served by L1/L2.
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
// A warp step thus covers 16 W rows x 32 k (a 64-byte run of each row) with 2 W loads, 1 X load
// and 2 mmas; D's c0..c3 land on lane (g, t) as Y[2t][n0+g], Y[2t+1][n0+g], Y[2t][n0+8+g],
// Y[2t+1][n0+8+g].
//
// Launch shape (tinyvllm/gpu/gemv.py picks it):
//   grid.x  = ceil(n / 16): a CTA owns the 16 outputs n0 .. n0 + 15 of every x row (one mma tile).
//   block.x = 32 * kw, kw in 1..32 warps that split K (split-K inside the CTA). The K range is
//             cut into 32-wide steps; warp w walks steps [w*S/kw, (w+1)*S/kw), S = ceil(k/32),
//             UNROLL = 4 steps (8 16-byte W loads per lane) in flight at a time.
//   shared  = kw * 512 bytes: each warp's 8 x 16 fp32 partial tile; after one __syncthreads the
//             first 16*m threads sum the kw partials of one output each and write it.
// Registers: 8 W uint4 + 4 X uint4 in flight + 4 accumulators; __launch_bounds__(1024) caps the
// kernel at 64 registers, so 32 warps fit on an SM whatever kw is (ptxas: 64 registers, no spills).
// The Python side chooses kw so that ceil(n/16) * kw fills the GPU about once (o/qkv: 16 warps of
// 4 steps, down: 32 warps of 8 steps, gate_up: 4 warps of 16 steps, lm_head: 1 warp of 64 steps):
// small matrices put their whole weight in flight at once, big ones stream with fewer, longer
// warps. No workspace, one launch, no atomics: every output is written by exactly one thread.
//
// Bounds: W rows >= n, k >= K (k % 8 == 0 is required, so a 16-byte chunk is all in or all out)
// and X rows >= m are never read (predicated loads, zeros in their place); outputs outside
// [m, n) are never written. x and w must be 16-byte aligned. The loop trip count and the mma are
// warp-uniform (they depend on the warp index only), as mma.sync requires.
// PDL-ready: the kernel executes griddepcontrol.wait after issuing its first W loads and before
// it touches X or Y. That is a no-op for an ordinary launch; under programmatic dependent launch
// the weight stream starts while the previous kernel (which produces X) is still finishing.
// It calls allow_consumer() first thing, so the next kernel can be resident before this one ends.
// Three entry points share this body and differ only in how X is loaded (XLoad below):
// gemv_bf16 (X as stored), gemv_rms_norm_bf16 (X = RMSNorm of the residual stream, computed per
// CTA; its wait comes before the loop, after L2 prefetches of the first W batch) and
// gemv_silu_mul_bf16 (X = silu(gate) * up from the gate_up rows). ptxas: 64 registers, no spills.
// -DGEMV_L2_PREFETCH=1 adds the .L2::256B prefetch hint to the W loads (benchmarks/gemv_bench.py
// compares both; the default build has no hint).
#include "common.cuh"

namespace {

constexpr int ROWS_PER_CTA = 16;   // W rows (outputs n) per CTA: the M of one m16n8k16 tile
constexpr int STEP_K = 32;        // k per warp step: 4 lanes x 8 bf16 per W row
constexpr int UNROLL = 4;        // steps in flight per warp: 8 x 16-byte W loads per lane
constexpr int MAX_K_WARPS = 32;

#ifndef GEMV_L2_PREFETCH
#define GEMV_L2_PREFETCH 0
#endif
#if GEMV_L2_PREFETCH
#define GEMV_W_LOAD "ld.global.nc.L1::no_allocate.L2::256B.v4.u32"
#else
#define GEMV_W_LOAD "ld.global.nc.L1::no_allocate.v4.u32"
#endif

__device__ __forceinline__ uint4 load_stream(const bf16* p) {   // W: read once, keep out of L1
    uint4 v;
    asm volatile(GEMV_W_LOAD " {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// X: re-read by every CTA, cached in L1 (the default for ld.global on sm_90). Not .nc: X is the
// previous kernel's output, and under programmatic dependent launch that kernel may still run
// during this one, so X is not read-only for this kernel's lifetime; ptxas does hoist .nc loads
// (and __ldg) above griddepcontrol.wait. volatile keeps the load after the wait in the PTX.
__device__ __forceinline__ uint4 load_cached(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// c += A * B, A = {a0, a1, a2, a3} (16 x 16 bf16), B = {b0, b1} (16 x 8 bf16), c: 16 x 8 fp32.
__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


// One warp step: 16 W rows x 32 k against the X chunk (header: fragment layout).
__device__ __forceinline__ void mma_pair(float acc[4], const uint4& p, const uint4& q, const uint4& v) {
    mma_bf16(acc, p.x, q.x, p.y, q.y, v.x, v.y);
    mma_bf16(acc, p.z, q.z, p.w, q.w, v.z, v.w);
}

// How a kernel gets its X operand (B = X^T): the three GEMVs differ only in that load.
//   plain     X itself.
//   rms_norm  bf16(RMSNorm(x) * norm_w), x the residual stream: each CTA first recomputes the
//             inverse RMS of its <= 8 rows (cta_inv_rms), then scales every X chunk as it loads it
//             and rounds it to bf16 — the very value rms_norm would have stored (common.cuh).
//   silu_mul  bf16(silu(gate) * up) from the fused gate_up rows [m, 2k]: what silu_mul stores.
// The W stream, the mma order and the epilogue are the same code, so each fused kernel gives the
// bits of the unfused kernel pair (tests/test_gpu_fused.py checks that).
enum class XLoad { plain, rms_norm, silu_mul };

// The inverse RMS of x row g = lane / 4 (0 for lanes past m), computed by the whole CTA in the
// order rms_norm's block of NORM_THREADS threads uses (common.cuh's norm_partial_sum): "virtual
// warp" vw of that block sums threads 32 vw .. 32 vw + 31 with one warp_sum, and block_sum adds
// the 8 warp totals with a second warp_sum over lanes 0..7. Here the (row, vw) sums are spread
// over the CTA's warps, meet in shared memory, and every warp does the second stage itself.
// xor-butterfly sums leave the same value in every lane (fp addition commutes), so lane 0's
// copy, which block_sum stores, is any lane's. A virtual warp whose chunks all lie past the row
// sums to 0 in rms_norm too, and adding +0 to a sum of squares changes no bit: it is skipped.
// Must be reached by every thread of the CTA (one __syncthreads).
__device__ __forceinline__ float cta_inv_rms(const bf16* x, int m, int k, float eps, int lane,
                                             int warp, int warps) {
    constexpr int VIRTUAL_WARPS = NORM_THREADS / 32;
    constexpr int GROUP = 4;   // tasks whose loads a warp has in flight together
    static_assert(VIRTUAL_WARPS <= 32, "the second stage sums the virtual warps in one warp");
    __shared__ float part[8][VIRTUAL_WARPS];   // [x row][virtual warp]
    const int rows = m < 8 ? m : 8;
    const int tasks = rows * VIRTUAL_WARPS;
    // Task j of this warp is warp + j * warps: (row, vw) = (task / 8, task % 8). A group's chunk
    // loads are issued before any of its sums, each sum still visits its chunks in order.
    for (int j0 = 0; warp + j0 * warps < tasks; j0 += GROUP) {                   // warp-uniform
        float s[GROUP];
        const bf16* row[GROUP];
        int vt[GROUP];
        bool live[GROUP];
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int task = warp + (j0 + j) * warps;
            live[j] = task < tasks && (task % VIRTUAL_WARPS) * 32 * 8 < k;
            row[j] = x + (size_t)(live[j] ? task / VIRTUAL_WARPS : 0) * k;
            vt[j] = (task % VIRTUAL_WARPS) * 32 + lane;
            s[j] = 0.0f;
        }
        for (int c = 0; c < k; c += NORM_THREADS * 8) {
            uint4 raw[GROUP];
#pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                raw[j] = make_uint4(0u, 0u, 0u, 0u);
                if (live[j] && c + vt[j] * 8 < k) raw[j] = load_fresh(row[j] + c + vt[j] * 8);
            }
#pragma unroll
            for (int j = 0; j < GROUP; ++j)
                if (live[j] && c + vt[j] * 8 < k) s[j] = norm_add_chunk(s[j], raw[j]);
        }
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int task = warp + (j0 + j) * warps;
            if (task >= tasks) break;                    // warp-uniform
            const float total = live[j] ? warp_sum(s[j]) : 0.0f;
            if (lane == 0) part[task / VIRTUAL_WARPS][task % VIRTUAL_WARPS] = total;
        }
    }
    __syncthreads();
    float mine = 0.0f;
    for (int r = 0; r < rows; ++r) {
        const float total = warp_sum(lane < VIRTUAL_WARPS ? part[r][lane] : 0.0f);
        if (lane >> 2 == r) mine = norm_inv_rms(total, k, eps);
    }
    return mine;
}

// norm weight: written by no kernel, re-read by every CTA: the read-only cached path
__device__ __forceinline__ uint4 load_weight(const bf16* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint4 normalize(const uint4& x_raw, const uint4& w_raw, float inv_rms) {
    float v[8], nw[8];
    unpack_bf16x8(x_raw, v);
    unpack_bf16x8(w_raw, nw);
    return make_uint4(pack_bf16x2(norm_apply(v[0], inv_rms, nw[0]), norm_apply(v[1], inv_rms, nw[1])),
                      pack_bf16x2(norm_apply(v[2], inv_rms, nw[2]), norm_apply(v[3], inv_rms, nw[3])),
                      pack_bf16x2(norm_apply(v[4], inv_rms, nw[4]), norm_apply(v[5], inv_rms, nw[5])),
                      pack_bf16x2(norm_apply(v[6], inv_rms, nw[6]), norm_apply(v[7], inv_rms, nw[7])));
}

__device__ __forceinline__ uint4 swiglu(const uint4& gate_raw, const uint4& up_raw) {
    float g[8], u[8];
    unpack_bf16x8(gate_raw, g);
    unpack_bf16x8(up_raw, u);
    return make_uint4(pack_bf16x2(silu_times(g[0], u[0]), silu_times(g[1], u[1])),
                      pack_bf16x2(silu_times(g[2], u[2]), silu_times(g[3], u[3])),
                      pack_bf16x2(silu_times(g[4], u[4]), silu_times(g[5], u[5])),
                      pack_bf16x2(silu_times(g[6], u[6]), silu_times(g[7], u[7])));
}

__device__ __forceinline__ void prefetch_l2(const bf16* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// y: [m, n] bf16 (out_f32 = 0) or fp32 (out_f32 = 1), row stride n; w: [n, k] bf16; x per MODE:
// [m, k] bf16 (plain, rms_norm; norm_w [k]) or gate_up [m, 2k] bf16 (silu_mul).
// accumulate = 1: y += x @ w^T (fp32 sum of the old value and the product, rounded once).
template <XLoad MODE>
__device__ __forceinline__ void gemv_body(void* __restrict__ y, const bf16* __restrict__ x,
                                          const bf16* __restrict__ norm_w, const bf16* __restrict__ w,
                                          int m, int n, int k, float eps, int out_f32, int accumulate) {
    extern __shared__ float partial[];   // [warps][8 rows of x][16 columns of the CTA]
    allow_consumer();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * ROWS_PER_CTA;
    const int steps = (k + STEP_K - 1) / STEP_K;
    // k < 2^26 (checked in Python), so steps * warps < 2^26 fits an int.
    const int s_begin = warp * steps / warps, s_end = (warp + 1) * steps / warps;

    // This lane's two W rows (n0 + g, n0 + 8 + g) and its X row g; pointers of rows that do not
    // exist are clamped to row 0 and never dereferenced. silu_mul's X rows are gate_up rows
    // (gate at column kk, up at k + kk).
    const bool w_ok0 = n0 + g < n, w_ok1 = n0 + 8 + g < n, x_ok = g < m;
    const size_t x_stride = MODE == XLoad::silu_mul ? 2 * (size_t)k : (size_t)k;
    const bf16* w0 = w + (size_t)(w_ok0 ? n0 + g : 0) * k + 8 * t;
    const bf16* w1 = w + (size_t)(w_ok1 ? n0 + 8 + g : 0) * k + 8 * t;
    const bf16* xr = x + (x_ok ? g : 0) * x_stride + 8 * t;

    float inv_rms = 0.0f;
    if constexpr (MODE == XLoad::rms_norm) {
        // The norm needs all of X before the first X chunk, so the wait comes before the loop.
        // Holding this warp's first W loads in registers across the prologue would cost
        // registers the 64-register cap does not have; L2 prefetches start the same HBM traffic
        // under the previous kernel's tail, and the loop's first loads then hit L2.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kk = (s_begin + u) * STEP_K;
            if (s_begin + u < s_end && kk + 8 * t < k) {
                if (w_ok0) prefetch_l2(w0 + kk);
                if (w_ok1) prefetch_l2(w1 + kk);
            }
        }
        wait_for_producer();   // x is the residual stream the previous kernel wrote
        inv_rms = cta_inv_rms(x, m, k, eps, lane, warp, warps);
    }

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = s_begin; s0 < s_end; s0 += UNROLL) {
        uint4 wv0[UNROLL], wv1[UNROLL], xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kk = (s0 + u) * STEP_K;
            const bool in = s0 + u < s_end && kk + 8 * t < k;
            wv0[u] = wv1[u] = make_uint4(0u, 0u, 0u, 0u);
            if (in && w_ok0) wv0[u] = load_stream(w0 + kk);
            if (in && w_ok1) wv1[u] = load_stream(w1 + kk);
        }
        if (MODE != XLoad::rms_norm && s0 == s_begin) wait_for_producer();   // X is the previous kernel's output
        // Fused modes convert X chunk by chunk, each just before its mmas: 8 raw X/norm-weight
        // (or gate/up) quads in flight next to the 8 W quads would not fit 64 registers.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kk = (s0 + u) * STEP_K;
            const bool in = s0 + u < s_end && kk + 8 * t < k;
            xv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (in && x_ok) {
                if constexpr (MODE == XLoad::plain) {
                    xv[u] = load_cached(xr + kk);
                } else if constexpr (MODE == XLoad::rms_norm) {
                    xv[u] = normalize(load_cached(xr + kk), load_weight(norm_w + 8 * t + kk), inv_rms);
                } else {
                    xv[u] = swiglu(load_cached(xr + kk), load_cached(xr + k + kk));
                }
            }
            if constexpr (MODE != XLoad::plain) mma_pair(acc, wv0[u], wv1[u], xv[u]);
        }
        if constexpr (MODE == XLoad::plain) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) mma_pair(acc, wv0[u], wv1[u], xv[u]);
        }
    }
    wait_for_producer();   // warps without steps: Y is read/written below

    // Lane (g, t) holds Y[2t][n0+g], Y[2t+1][n0+g], Y[2t][n0+8+g], Y[2t+1][n0+8+g] (this warp's
    // share of K); partial[warp][row][column] with row = x row, column = n - n0.
    float* mine = partial + warp * (8 * ROWS_PER_CTA) + 2 * t * ROWS_PER_CTA + g;
    mine[0] = acc[0];
    mine[ROWS_PER_CTA] = acc[1];
    mine[8] = acc[2];
    mine[ROWS_PER_CTA + 8] = acc[3];
    __syncthreads();

    const int rows = m < 8 ? m : 8;   // m <= 8 is checked in Python; never read past the tile
    for (int i = threadIdx.x; i < rows * ROWS_PER_CTA; i += blockDim.x) {
        const int row = i / ROWS_PER_CTA, col = n0 + i % ROWS_PER_CTA;
        if (col >= n) continue;
        float sum = 0.f;
        for (int v = 0; v < warps; ++v) sum += partial[v * (8 * ROWS_PER_CTA) + i];
        const size_t at = (size_t)row * n + col;
        if (out_f32) {
            float* yf = static_cast<float*>(y);
            yf[at] = accumulate ? yf[at] + sum : sum;
        } else {
            bf16* yb = static_cast<bf16*>(y);
            yb[at] = __float2bfloat16(accumulate ? __bfloat162float(yb[at]) + sum : sum);
        }
    }
}

}  // namespace

// Y (+)= X @ W^T. y: [m, n] bf16 (out_f32 = 0) or fp32 (out_f32 = 1); x: [m, k]; w: [n, k].
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_bf16(void* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ w,
          int m, int n, int k, int out_f32, int accumulate) {
    gemv_body<XLoad::plain>(y, x, nullptr, w, m, n, k, 0.0f, out_f32, accumulate);
}

// Y (+)= (RMSNorm(x) * norm_w) @ W^T with the norm output rounded to bf16 (= rms_norm, then
// gemv_bf16). x: the residual stream [m, k]; norm_w: [k].
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_rms_norm_bf16(void* __restrict__ y, const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                   const bf16* __restrict__ w, int m, int n, int k, float eps, int out_f32, int accumulate) {
    gemv_body<XLoad::rms_norm>(y, x, norm_w, w, m, n, k, eps, out_f32, accumulate);
}

// Y (+)= (silu(gate) * up) @ W^T with the activation rounded to bf16 (= silu_mul, then
// gemv_bf16). gate_up: [m, 2k], gate in columns [0, k), up in [k, 2k).
extern "C" __global__ void __launch_bounds__(MAX_K_WARPS * 32)
gemv_silu_mul_bf16(void* __restrict__ y, const bf16* __restrict__ gate_up, const bf16* __restrict__ w,
                   int m, int n, int k, int out_f32, int accumulate) {
    gemv_body<XLoad::silu_mul>(y, gate_up, nullptr, w, m, n, k, 0.0f, out_f32, accumulate);
}
