// RoPE (llama3-scaled frequencies precomputed on the host) fused with the KV-cache write.
// For token t: rotate its q heads in place inside the fused qkv row, rotate its k heads and write
// them, with its v heads, to the paged cache at slot_mapping[t] (slot < 0: padding, no write).
// Pairs are (i, i + head_dim/2) — the "rotate half" convention of HF Llama checkpoints.
// The rotation is common.cuh's rope_rotate (full-range sincosf, each rounding written out), which
// the qkv GEMV's fused epilogue (gemv.cu, decode) also calls: both give the same bits.
// Launch: one block per token, threads over (head, pair) and then over the v row.
#include "common.cuh"

constexpr int THREADS = 256;   // block size (gpu/ops/rowwise.py launches with it)

extern "C" __global__ void __launch_bounds__(THREADS) rope_write_kv(bf16* __restrict__ qkv, bf16* __restrict__ k_cache,
                                         bf16* __restrict__ v_cache, const int* __restrict__ positions,
                                         const int* __restrict__ slot_mapping,
                                         const float* __restrict__ inv_freq, int num_tokens,
                                         int num_q_heads, int num_kv_heads, int head_dim) {
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

    for (int p = threadIdx.x; p < (num_q_heads + num_kv_heads) * half; p += blockDim.x) {
        const int head = p / half, i = p % half;
        const bool is_q = head < num_q_heads;
        const bf16* x = is_q ? q + head * head_dim : k + (head - num_q_heads) * head_dim;
        const float x1 = __bfloat162float(x[i]), x2 = __bfloat162float(x[i + half]);
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
    if (slot < 0) return;
    for (int e = threadIdx.x; e < kv_row; e += blockDim.x) v_cache[(size_t)slot * kv_row + e] = v[e];
}
