// RoPE (llama3-scaled frequencies precomputed on the host) fused with the KV-cache write.
// For token t: rotate its q heads in place inside the fused qkv row, rotate its k heads and write
// them, with its v heads, to the paged cache at slot_mapping[t] (slot < 0: padding, no write).
// Pairs are (i, i + head_dim/2) — the "rotate half" convention of HF Llama checkpoints.
// The rotation is common.cuh's rope_rotate (full-range sincosf, each rounding written out), which
// the qkv GEMV's fused epilogue (gemv.cu, decode) also calls: both give the same bits.
// Launch: one block per token, threads over (head, pair) and then over the v row.
//
// Three kernels, one body (RopeMode; the Llama kernel's code has none of the others' steps):
//   rope_write_kv          Llama, Mistral.
//   rope_write_kv_bias     Qwen2's q/k/v biases, added here because this kernel reads the qkv
//                          rows anyway: every value is bf16(qkv + bias), qkv as the projection
//                          stored it (the add rounded once more, as the GEMV's bias epilogue
//                          does: reference/model.py rounds the same two places), v included.
//   rope_write_kv_qk_norm  Qwen3's and Gemma 3's q_norm / k_norm: each q and k head RMS-normalised
//                          over its head_dim values before RoPE, times (weight_offset + w) with the
//                          sum in fp32 (Gemma 3: 1 + w), rounded to bf16 (where the reference model
//                          stores it), then rotated. One warp per head: it holds the whole head, so
//                          its sum of squares is one warp_sum (the fused decode GEMV's CTAs hold
//                          16 rows of a head each, so these families' decode runs this kernel after
//                          the qkv GEMV).
#include "common.cuh"

constexpr int THREADS = 256;   // block size (gpu/ops/rowwise.py launches with it)

enum class RopeMode { plain, bias, qk_norm };

// The per-head q/k norm's weights (RopeMode::qk_norm): q_norm and k_norm [head_dim].
struct QkNorm {
    const bf16* q_weight;
    const bf16* k_weight;
    float eps, weight_offset;
};

template <RopeMode MODE>
__device__ __forceinline__ void rope_kv_body(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                             bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                             const int* __restrict__ slot_mapping,
                                             const float* __restrict__ inv_freq, int num_tokens,
                                             int num_q_heads, int num_kv_heads, int head_dim,
                                             const bf16* __restrict__ bias, const QkNorm& norm) {
    allow_consumer();
    wait_for_producer();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int half = head_dim / 2;
    const int kv_row = num_kv_heads * head_dim;
    bf16* q = qkv + (size_t)t * (num_q_heads * head_dim + 2 * kv_row);
    bf16* k = q + num_q_heads * head_dim;
    const bf16* v = k + kv_row;
    const float pos = (float)positions[t];
    const int slot = slot_mapping[t];
    // bias: qkv's value at column c of the row, the projection's bias added
    auto biased = [&](const bf16* row, int c) {
        return bf16_round(__fadd_rn(__bfloat162float(row[c]), __bfloat162float(bias[c])));
    };

    if constexpr (MODE == RopeMode::qk_norm) {
        const int lane = threadIdx.x % 32;
        for (int head = threadIdx.x / 32; head < num_q_heads + num_kv_heads; head += blockDim.x / 32) {
            const bool is_q = head < num_q_heads;
            bf16* x = is_q ? q + head * head_dim : k + (head - num_q_heads) * head_dim;
            const bf16* w = is_q ? norm.q_weight : norm.k_weight;
            float sum_sq = 0.0f;
            for (int i = lane; i < head_dim; i += 32) {
                const float xi = __bfloat162float(x[i]);
                sum_sq = __fadd_rn(sum_sq, __fmul_rn(xi, xi));
            }
            // every lane's reads are done once the sum meets (warp_sum's shuffles), before any write
            const float inv_rms = norm_inv_rms(warp_sum(sum_sq), head_dim, norm.eps);
            bf16* dst = is_q ? x : (slot >= 0 ? k_cache + (size_t)slot * kv_row + (head - num_q_heads) * head_dim : nullptr);
            for (int i = lane; i < half; i += 32) {
                const float x1 = bf16_round(norm_apply(__bfloat162float(x[i]), inv_rms,
                                                       __fadd_rn(__bfloat162float(w[i]), norm.weight_offset)));
                const float x2 = bf16_round(norm_apply(__bfloat162float(x[i + half]), inv_rms,
                                                       __fadd_rn(__bfloat162float(w[i + half]), norm.weight_offset)));
                float r1, r2;
                rope_rotate(x1, x2, pos, inv_freq[i], r1, r2);
                if (dst) {
                    dst[i] = __float2bfloat16(r1);
                    dst[i + half] = __float2bfloat16(r2);
                }
            }
        }
    } else {
        for (int p = threadIdx.x; p < (num_q_heads + num_kv_heads) * half; p += blockDim.x) {
            const int head = p / half, i = p % half;
            const bool is_q = head < num_q_heads;
            float x1, x2;
            if constexpr (MODE == RopeMode::bias) {   // q and k sit side by side: column head * D + i
                x1 = biased(q, head * head_dim + i);
                x2 = biased(q, head * head_dim + i + half);
            } else {
                const bf16* x = is_q ? q + head * head_dim : k + (head - num_q_heads) * head_dim;
                x1 = __bfloat162float(x[i]);
                x2 = __bfloat162float(x[i + half]);
            }
            float r1, r2;
            rope_rotate(x1, x2, pos, inv_freq[i], r1, r2);
            const bf16 y1 = __float2bfloat16(r1), y2 = __float2bfloat16(r2);
            bf16* dst;
            if (is_q) {
                dst = q + head * head_dim;
            } else if (slot >= 0) {
                dst = k_cache + (size_t)slot * kv_row + (head - num_q_heads) * head_dim;
            } else {
                continue;
            }
            dst[i] = y1;
            dst[i + half] = y2;
        }
    }
    if (slot < 0) return;
    for (int e = threadIdx.x; e < kv_row; e += blockDim.x) {
        if constexpr (MODE == RopeMode::bias)
            v_cache[(size_t)slot * kv_row + e] = __float2bfloat16(biased(q, (num_q_heads * head_dim + kv_row) + e));
        else
            v_cache[(size_t)slot * kv_row + e] = v[e];
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) rope_write_kv(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                         bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                         const int* __restrict__ slot_mapping,
                                         const float* __restrict__ inv_freq, int num_tokens,
                                         int num_q_heads, int num_kv_heads, int head_dim) {
    rope_kv_body<RopeMode::plain>(qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens,
                                  num_q_heads, num_kv_heads, head_dim, nullptr, QkNorm{});
}

// bias: [(num_q_heads + 2 num_kv_heads) * head_dim], the q, k and v biases side by side as qkv's columns.
extern "C" __global__ void __launch_bounds__(THREADS) rope_write_kv_bias(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                         bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                         const int* __restrict__ slot_mapping,
                                         const float* __restrict__ inv_freq, int num_tokens,
                                         int num_q_heads, int num_kv_heads, int head_dim,
                                         const bf16* __restrict__ bias) {
    rope_kv_body<RopeMode::bias>(qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens,
                                 num_q_heads, num_kv_heads, head_dim, bias, QkNorm{});
}

// q_norm, k_norm: [head_dim] each; every head's values x / rms(x) * (weight_offset + w).
extern "C" __global__ void __launch_bounds__(THREADS) rope_write_kv_qk_norm(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                         bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                         const int* __restrict__ slot_mapping,
                                         const float* __restrict__ inv_freq, int num_tokens,
                                         int num_q_heads, int num_kv_heads, int head_dim,
                                         const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
                                         float eps, float weight_offset) {
    rope_kv_body<RopeMode::qk_norm>(qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens,
                                    num_q_heads, num_kv_heads, head_dim, nullptr,
                                    QkNorm{q_norm, k_norm, eps, weight_offset});
}
