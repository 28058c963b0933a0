// Token embedding gather: out[t, :] = table[id_t, :], where id_t = token_ids[t], or, for a token
// fed from the step before (async scheduling: fed_rows non-null and fed_rows[t] >= 0), that
// step's sampled id fed_ids[fed_rows[t]] — read here, on the device, because the host has not
// read it back yet when this step is launched (engine/batch.py, "Fed tokens").
// Launch: one block per token, threads stride over the row 16 bytes at a time. Requires
// hidden % 8 == 0. Out-of-range ids produce a zero row rather than a wild read.
//
// The handed-over norm (norm_w non-null; the fused decode layer's default, gpu/model.py): the
// first layer's input RMSNorm has no residual GEMV before it to hand it over (gemv.cu's
// gemv_residual_norm), so the gather does that GEMV's part: normed[t] = bf16(out[t] * norm_w)
// and row_ss[t][c] = the sum of squares of out[t]'s columns 16c .. 16c + 15 (chunk_sum_sq's tree),
// the operand and the row sums the prenormed qkv GEMV reads. The first layer's norm then needs
// no launch of its own, as every other norm of the step. Requires hidden % 16 == 0 (checked in
// gpu/ops/rowwise.py; the prenormed GEMV needs hidden % 64 == 0 anyway).
//
// head_argmax (non-null: the decode LM head keeps each row's greedy argmax key, gemv.cu's
// gemv_prenormed_bf16): the gather, the step's first kernel, sets row t's key to 0, the value the
// head's atomicMax starts from. Every later kernel waits for the one before it, so the clear is
// complete before the head's first atomic, and the sampler of the step before has read its key.
// embedding_gather_scaled (Gemma 3): every value times `scale` (bf16(sqrt(hidden)): transformers
// casts the scale to the activations' dtype), the product rounded to bf16, and a handed-over norm
// of weight (norm_offset + w) (Gemma's 1 + w, the sum in fp32). Its own instantiation, so the
// plain kernel's code has neither.
#include "common.cuh"

constexpr int THREADS = 128;   // block size (gpu/ops/rowwise.py launches with it)

namespace {

// Eight bf16 values times scale, each product rounded to bf16 (embedding_gather_scaled).
__device__ __forceinline__ uint4 scaled(const uint4& raw, float scale) {
    float v[8];
    unpack_bf16x8(raw, v);
    uint4 out;
    out.x = pack_bf16x2(__fmul_rn(v[0], scale), __fmul_rn(v[1], scale));
    out.y = pack_bf16x2(__fmul_rn(v[2], scale), __fmul_rn(v[3], scale));
    out.z = pack_bf16x2(__fmul_rn(v[4], scale), __fmul_rn(v[5], scale));
    out.w = pack_bf16x2(__fmul_rn(v[6], scale), __fmul_rn(v[7], scale));
    return out;
}

template <bool SCALED>
__device__ __forceinline__ void embedding_body(bf16* __restrict__ out, const bf16* __restrict__ table,
                                               const int* __restrict__ token_ids, const int* __restrict__ fed_rows,
                                               const int* __restrict__ fed_ids, int num_tokens,
                                               int hidden, int vocab_size, const bf16* __restrict__ norm_w,
                                               bf16* __restrict__ normed, float* __restrict__ row_ss,
                                               unsigned long long* __restrict__ head_argmax, float scale,
                                               float norm_offset) {
    allow_consumer();
    wait_for_producer();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    if (head_argmax && threadIdx.x == 0) head_argmax[t] = 0ull;   // the LM head's atomicMax starts from 0
    const int fed = fed_rows ? fed_rows[t] : -1;
    // a fed id of -1 (the sampler's non-finite row, thrown away by the engine) is out of range:
    // a zero row, like any other
    const int id = fed >= 0 ? fed_ids[fed] : token_ids[t];
    const bool valid = id >= 0 && id < vocab_size;
    const bf16* src = table + (size_t)(valid ? id : 0) * hidden;   // read only when valid
    bf16* dst = out + (size_t)t * hidden;
    if (!norm_w) {
        for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (valid) v = *reinterpret_cast<const uint4*>(src + col);
            if constexpr (SCALED) v = scaled(v, scale);
            *reinterpret_cast<uint4*>(dst + col) = v;
        }
        return;
    }
    // handed-over norm: one 16-column chunk per thread and iteration
    const int chunks = hidden / SS_CHUNK;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int col = c * SS_CHUNK;
        uint4 raw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (valid) {
            raw[0] = *reinterpret_cast<const uint4*>(src + col);
            raw[1] = *reinterpret_cast<const uint4*>(src + col + 8);
        }
        if constexpr (SCALED) {
            raw[0] = scaled(raw[0], scale);
            raw[1] = scaled(raw[1], scale);
        }
        float v[SS_CHUNK], w[SS_CHUNK];
        unpack_bf16x8(raw[0], v);
        unpack_bf16x8(raw[1], v + 8);
        load_bf16x8(norm_w + col, w);
        load_bf16x8(norm_w + col + 8, w + 8);
        *reinterpret_cast<uint4*>(dst + col) = raw[0];
        *reinterpret_cast<uint4*>(dst + col + 8) = raw[1];
        row_ss[(size_t)t * chunks + c] = chunk_sum_sq(v);
        // the product of two bf16 values is exact in fp32: one rounding, as gemv_residual_norm's
        // (scaled: offset + w may hold more bits; the fp32 product is rounded, then stored in bf16,
        // as reference/kernels.py's rms_norm_operand(weight_offset=) does)
#pragma unroll
        for (int i = 0; i < SS_CHUNK; ++i) w[i] = __fmul_rn(v[i], SCALED ? __fadd_rn(w[i], norm_offset) : w[i]);
        store_bf16x8(normed + (size_t)t * hidden + col, w);
        store_bf16x8(normed + (size_t)t * hidden + col + 8, w + 8);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) embedding_gather(bf16* __restrict__ out, const bf16* __restrict__ table,
                                            const int* __restrict__ token_ids, const int* __restrict__ fed_rows,
                                            const int* __restrict__ fed_ids, int num_tokens,
                                            int hidden, int vocab_size, const bf16* __restrict__ norm_w,
                                            bf16* __restrict__ normed, float* __restrict__ row_ss,
                                            unsigned long long* __restrict__ head_argmax) {
    embedding_body<false>(out, table, token_ids, fed_rows, fed_ids, num_tokens, hidden, vocab_size, norm_w, normed,
                          row_ss, head_argmax, 1.0f, 0.0f);
}

extern "C" __global__ void __launch_bounds__(THREADS) embedding_gather_scaled(bf16* __restrict__ out, const bf16* __restrict__ table,
                                            const int* __restrict__ token_ids, const int* __restrict__ fed_rows,
                                            const int* __restrict__ fed_ids, int num_tokens,
                                            int hidden, int vocab_size, const bf16* __restrict__ norm_w,
                                            bf16* __restrict__ normed, float* __restrict__ row_ss,
                                            unsigned long long* __restrict__ head_argmax, float scale, float norm_offset) {
    embedding_body<true>(out, table, token_ids, fed_rows, fed_ids, num_tokens, hidden, vocab_size, norm_w, normed,
                         row_ss, head_argmax, scale, norm_offset);
}
