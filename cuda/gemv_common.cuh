// What the bf16 GEMV (gemv.cu) and the quantized one (gemv_quant.cu) share; they differ only in how
// they read W. The mma pair (gemv.cu's header: the fragment layout), how a kernel gets its X operand,
// and the epilogue: the sum of the warps' partial tiles and what each mode does with a CTA's 16
// outputs per x row (gemv.cu's header explains each mode). The including file defines ROWS_PER_CTA
// (16: one m16n8k16 tile's M) first.
#pragma once
#include "common.cuh"

namespace {

// The sources of a warp's first STEPS X copies, computed before griddepcontrol.wait and held
// (common.cuh's hold), so that after the wait, where the step's critical path runs, only the
// copies follow (gemv.cu's ring header). Step i copies row + at(i) when the row exists, i < steps
// and its first k (at(i) + lane_k, `row` starting lane_k into the row) is below k; else a 16-byte
// zero fill from `row` that reads nothing (no step reads it).
template <int STEPS, typename At>
__device__ __forceinline__ void first_x_sources(const bf16* row, bool row_ok, int steps, int lane_k, int k, At at,
                                                const void* (&src)[STEPS], int (&bytes)[STEPS]) {
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const int offset = at(i);
        const bool in = row_ok && i < steps && offset + lane_k < k;
        src[i] = in ? row + offset : row;
        bytes[i] = in ? 16 : 0;
        hold(src[i]), hold(bytes[i]);
    }
}

// One warp step's tensor-core work on one quad per lane: 16 W rows (p: row g, q: row g + 8) x 32 k
// (8 per lane) against the X quad v of row g (the same 8 k, in the same order as p's and q's).
__device__ __forceinline__ void mma_pair(float acc[4], const uint4& p, const uint4& q, const uint4& v) {
    mma_bf16(acc, p.x, q.x, p.y, q.y, v.x, v.y);
    mma_bf16(acc, p.z, q.z, p.w, q.w, v.z, v.w);
}

// How a kernel gets its X operand (B = X^T) and what its epilogue does with Y.
//   plain       X as stored.
//   prenormed   X is bf16(x * norm weight) already, written with its sums of squares by the
//               residual GEMV before (Epilogue::residual_norm): the kernel only scales.
// residual_norm: Y += X @ W^T (the residual add, bf16), and for the norm after it
// bf16(Y * norm weight) and each CTA's sum of Y's squares per row (the handed-over norm, header).
enum class XLoad { plain, prenormed };
enum class Epilogue { store, rope_kv, silu_mul, residual_norm, gelu_mul };

// The handed-over norm of X (prenormed).
struct NormArgs {
    float eps;
    const float* row_ss;   // the producer's per-CTA sums of squares [m][ceil(k / 16)]
};

// What Epilogue::residual_norm writes besides Y.
struct NormOut {
    const bf16* weight;    // the next norm's gain [n]
    bf16* normed;          // [m, n]: bf16(Y * weight)
    float* row_ss;         // [m][gridDim.x]: this CTA's sum of its 16 columns' Y^2 per row
};

// What the RoPE + KV-write epilogue needs besides Y (= the qkv rows [m, n], n = (Hq + 2 Hkv) D).
struct RopeArgs {
    bf16* k_cache;
    bf16* v_cache;           // [slots, Hkv, D]
    const int* positions;    // [m]
    const int* slot_mapping; // [m]; < 0: padding, nothing written to the cache
    const float* inv_freq;   // [D / 2]
    int num_q_heads, num_kv_heads, head_dim;
    const bf16* bias;        // the q/k/v biases [n] (Qwen2; only where the kernel adds them)
};

// The CTA's 16 W rows: row_a + 0..7 (tile columns 0..7) and row_b + 0..7 (columns 8..15).
struct Tile {
    int row_a, row_b;
};

template <Epilogue EPI>
__device__ __forceinline__ Tile cta_tile(int cta, int n, int head_dim) {
    if constexpr (EPI == Epilogue::store || EPI == Epilogue::residual_norm) {
        return {cta * ROWS_PER_CTA, cta * ROWS_PER_CTA + 8};
    } else if constexpr (EPI == Epilogue::silu_mul || EPI == Epilogue::gelu_mul) {   // gate rows [0, n/2), up [n/2, n)
        return {cta * 8, n / 2 + cta * 8};
    } else {                                                  // head_dim / 16 CTAs per head
        const int per_head = head_dim / ROWS_PER_CTA;
        const int a = (cta / per_head) * head_dim + (cta % per_head) * 8;
        return {a, a + head_dim / 2};
    }
}

// The sum of x over the 16 lanes of one epilogue row (a half warp: lanes i0 .. i0 + 15 hold its
// 16 tile columns) in a fixed butterfly, so every CTA adds in the same order. Every lane of the
// warp must call it.
__device__ __forceinline__ float row_sum16(float x) {
#pragma unroll
    for (int lane_mask = 1; lane_mask < ROWS_PER_CTA; lane_mask <<= 1) x += __shfl_xor_sync(0xffffffffu, x, lane_mask);
    return x;
}

// The largest of x over the 16 lanes of one epilogue row, as row_sum16 (the LM head's argmax keys).
__device__ __forceinline__ unsigned long long row_max16(unsigned long long x) {
#pragma unroll
    for (int lane_mask = 1; lane_mask < ROWS_PER_CTA; lane_mask <<= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, x, lane_mask);
        x = other > x ? other : x;
    }
    return x;
}

// The epilogue of a GEMV CTA, once its warps' partial tiles are in `partial` ([warps][8 rows of x]
// [16 columns]) after a __syncthreads: the 16 outputs of each x row summed over the warps, scaled
// by the row's scale (ROW_SCALE: FP8's per-output scale, row_scale[out]) and by the handed-over
// norm's inv_rms (prenormed: producer_ss [m][ss_count] in shared memory), then stored as EPI says.
template <XLoad MODE, Epilogue EPI, bool QKV_BIAS = false, bool ROW_SCALE = false>
__device__ __forceinline__ void gemv_epilogue(const float* partial, int warps, void* __restrict__ y, int m, int n,
                                              int k, int out_f32, int accumulate, float eps,
                                              const float* producer_ss, int ss_count, const RopeArgs& rope,
                                              const NormOut& norm_out, unsigned long long* head_argmax,
                                              const float* __restrict__ row_scale = nullptr) {
    // Thread i of a pass owns (x row i / 16, tile column i % 16): a half warp holds one row's 16
    // columns, so partners (column c and c + 8) are 8 lanes apart. The passes are block-uniform
    // and every lane takes part in the shuffles; rows*16 is a multiple of 16, so a half warp is
    // all live or all not.
    const int rows = m < 8 ? m : 8;   // m <= 8 is checked in Python; never read past the tile
    const Tile tile = cta_tile<EPI>(blockIdx.x, n, rope.head_dim);   // again: nothing lives across the loop
    for (int i0 = 0; i0 < rows * ROWS_PER_CTA; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const bool live = i < rows * ROWS_PER_CTA;
        const int row = live ? i / ROWS_PER_CTA : 0, col = i % ROWS_PER_CTA;
        const int out = col < 8 ? tile.row_a + col : tile.row_b + col - 8;   // the W row = Y column
        const bool in_n = live && out < n;
        float sum = 0.f;
        if (in_n)
            for (int v = 0; v < warps; ++v) sum += partial[v * (8 * ROWS_PER_CTA) + i];
        if constexpr (ROW_SCALE) {
            if (in_n) sum *= row_scale[out];
        }
        if constexpr (MODE == XLoad::prenormed) {   // the norm's scale, from the producer's sums
            // the row's 16 lanes each add every 16th partial, then meet in a fixed butterfly:
            // every CTA gets the same inv_rms (all lanes take part: the shuffles need them).
            // Fast division and rsqrt (2 ulp each, far below the bf16 rounding of the operand).
            float row_sum_sq = 0.f;
            if (live)
                for (int c = col; c < ss_count; c += ROWS_PER_CTA) row_sum_sq += producer_ss[row * ss_count + c];
            sum *= rsqrtf(__fdividef(row_sum16(row_sum_sq), (float)k) + eps);
        }
        if constexpr (EPI == Epilogue::store || EPI == Epilogue::residual_norm) {
            const size_t at = (size_t)row * n + out;
            float stored = 0.f;   // the bf16 Y value written (residual_norm: what the next kernels read)
            if (in_n && out_f32) {
                float* yf = static_cast<float*>(y);
                yf[at] = accumulate ? yf[at] + sum : sum;
            } else if (in_n) {
                bf16* yb = static_cast<bf16*>(y);
                const bf16 value = __float2bfloat16(accumulate ? __bfloat162float(yb[at]) + sum : sum);
                yb[at] = value;
                stored = __bfloat162float(value);
            }
            if constexpr (EPI == Epilogue::residual_norm) {   // the next norm's operand, this CTA's part of its sum
                if (in_n) norm_out.normed[at] = __float2bfloat16(stored * __bfloat162float(norm_out.weight[out]));
                const float sq = row_sum16(stored * stored);
                if (live && col == 0) norm_out.row_ss[(size_t)row * gridDim.x + blockIdx.x] = sq;
            }
            if constexpr (EPI == Epilogue::store && MODE == XLoad::prenormed) {
                if (head_argmax) {   // the LM head: the row's greedy argmax key (common.cuh), fp32 logits only
                    const unsigned long long key = row_max16(in_n ? argmax_key(sum, out) : 0ull);
                    if (live && col == 0) atomicMax(head_argmax + row, key);
                }
            }
        } else {
            // Both fused epilogues read the product as the unfused chain's next kernel would:
            // rounded to bf16 (the scaled product). The partner of column c is column c ^ 8 (the other run).
            float value = bf16_round(sum);
            if constexpr (QKV_BIAS) value = bf16_round(__fadd_rn(value, in_n ? __bfloat162float(rope.bias[out]) : 0.0f));
            const float partner = __shfl_xor_sync(0xffffffffu, value, 8);
            bf16* yb = static_cast<bf16*>(y);
            if constexpr (EPI == Epilogue::silu_mul) {         // value = gate (col < 8), partner = up
                if (in_n && col < 8) yb[(size_t)row * (n / 2) + out] = __float2bfloat16(silu_times(value, partner));
            } else if constexpr (EPI == Epilogue::gelu_mul) {
                if (in_n && col < 8) yb[(size_t)row * (n / 2) + out] = __float2bfloat16(gelu_tanh_times(value, partner));
            } else if (in_n) {
                const int D = rope.head_dim, half = D / 2, kv_row = rope.num_kv_heads * D;
                const int head = out / D, d = out % D;
                yb[(size_t)row * n + out] = __float2bfloat16(value);   // qkv as the GEMV stores it
                const int slot = rope.slot_mapping[row];
                if (head < rope.num_q_heads + rope.num_kv_heads) {     // q or k: rotate the pair
                    float y1, y2;
                    rope_rotate(col < 8 ? value : partner, col < 8 ? partner : value,
                                (float)rope.positions[row], rope.inv_freq[d % half], y1, y2);
                    const bf16 rotated = __float2bfloat16(col < 8 ? y1 : y2);
                    if (head < rope.num_q_heads)
                        yb[(size_t)row * n + out] = rotated;            // q: rotated in place
                    else if (slot >= 0)
                        rope.k_cache[(size_t)slot * kv_row + (head - rope.num_q_heads) * D + d] = rotated;
                } else if (slot >= 0) {
                    rope.v_cache[(size_t)slot * kv_row + (head - rope.num_q_heads - rope.num_kv_heads) * D + d] =
                        __float2bfloat16(value);
                }
            }
        }
    }
}

}  // namespace
