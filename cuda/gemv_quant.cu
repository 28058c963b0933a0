// Small-batch GEMV on quantized weights:  Y[m, n] (+)= X[m, k] @ W[n, k]^T,  1 <= m <= 8, W stored
// as FP8 (e4m3 codes + one fp32 scale per output row), as GGUF blocks of 32 (Q8_0, Q4_0, Q4_1), as
// GGUF super-blocks of 256 (Q4_K, Q6_K) or as a fused group of GGUF blocks in mixed formats (EXPANDED).
//
// Decode at batch <= 8 reads every weight once per step, so its time is the weight bytes: one byte
// per weight for FP8 and Q8_0 (plus 2-4 bytes of scale per 32), half a byte for Q4_0 / Q4_1, against
// bf16's two. This kernel is gemv.cu's weight stream (read its header first: the m16n8k16 fragment
// trick, the per-warp cp.async ring, the k-split inside the CTA, the partial tiles summed once)
// with the weight bytes turned into bf16 in registers between the ring and the mma:
//
//   lane (g = lane/4, t = lane%4) copies 16 weight bytes of the CTA's W rows row_a + g and
//   row_b + g (cta_tile, gemv_common.cuh: n0 + g and n0 + 8 + g but in the fused modes) per step,
//   LANE_K weights each (16 for one-byte formats, 32 for nibbles), at k = kk + LANE_K * t, and
//   the X values of row g at the same k (LANE_K / 8 quads); STEP_K = 4 * LANE_K.
//   Each group of 8 weights becomes one bf16 quad (8 values) and meets its X quad in gemv.cu's
//   mma pair: within one pair every lane with the same t holds matching physical k in A and B, so
//   the pair sums matching products only, whichever 8 k of its chunk the group covers.
//
// The nibble kinds' factored product (Q4_0, Q4_1, Q4_K; twin: quant/block_format.py's
// linear_factored, bound: factored_error_bound). A block of 32 weights is w = a * c + b (Q4_0:
// (d, -8 d), Q4_1: (d, m), Q4_K per sub-block: (d * sc, -(dmin * mn))), so
//     sum_k w_k x_k = a * sum_k (128 + c_k) x_k + (b - 128 a) * sum_k x_k.
// The raw codes go to the tensor cores as the bf16 value 128 + c (one PRMT + one LOP3 a pair:
// 0x4300 | c is 128 + c exactly, bf16's ulp at 128 being 1; the products (128 + c) x are exact in
// fp32), each block's pair of mma k-steps into a fresh fragment P, beside a pair with A = 1 giving
// the block's X sums S; then acc += a * P + fl32(b - 128 a) * S. No weight is rounded to bf16;
// the result is the exact product up to fp32 roundings. Why 128 + c and not c: subtracting 128
// (or 136: c - 8) in bf16 is exact too but costs one HADD2 a pair, 32 a lane-step, and buys only
// smaller fp32 partial sums (the bias's cancellation costs ~4 of fp32's 24 bits, against the 8
// of the bf16 rounding it replaces); Q4_0 would then skip S, the other two not.
// To give one block to one mma pair, a step's 4 lanes t of a row group read one block each in
// turn: lane (g, t) copies its 16 bytes to slot position 8 t + g (block-major: the 8-byte reads
// of one block by lanes (g, t) then hit 32 distinct banks) and reads group t of block b (8 codes:
// the low nibbles of bytes 0..7, 8..15, the high ones of 0..7, 8..15 for t = 0..3) with X quad t of
// the lane (g, b) that copied the block's X; the scale entries of lane (g, b) likewise.
// SASS of the plain Q4_1 kernel's main loop (cuobjdump -sass, backward branch to its target;
// copies and ring waits included): 390 instructions a lane-step dequantizing to bf16 (64 I2FP,
// 64 FFMA, 64 SHF, 56 LOP3, 32 F2FP, 8 HMMA), 319 factored (72 LOP3, 32 PRMT, 40 FFMA, 16 HMMA,
// 17 LDS); Q4_0 453 -> 322, Q4_K 386 -> 306; bf16's gemv.cu ~20 for a quarter of the weights.
// Q8_0 (231) could factor its d the same way (int8 codes as bf16: exact, |q| <= 128 needs 8
// bits) and save its 32 FMUL + 16 F2FP; not done here.
//
// The dequantization in registers of the other kinds (every value exact up to the one bf16
// rounding the numpy twins state: quant/fp8.py, quant/block_format.py's linear_dequantized), and
// of every kind in prefill's dequant_<kind>:
//   FP8    e4m3 -> f16 (cvt, exact) -> f32 -> bf16 (exact: 3 mantissa bits, exponents 2^-9 .. 2^8).
//          The row's scale multiplies the fp32 sum once, after the dot product.
//   Q8_0   bf16(d * q)              d: the block's fp16 scale, q: int8 (the product exact in f32)
//   Q4_0   bf16(d * (c - 8))        c: the 4-bit code; byte j of a block holds c[j] (low nibble)
//                                   and c[j + 16] (high nibble)
//   Q4_1   bf16(fmaf(d, c, m))      m: the block's fp16 min; d * c exact, the sum rounded once
//   Q4_K   bf16(fmaf(a, c, b))      per sub-block of 32: a = d * sc, b = -(dmin * mn), both computed
//                                   at upload in fp32 (exact: 11 + 6 bits each); c the 4-bit code;
//                                   a * c exact (21 bits), the sum rounded once: the twin's
//                                   fl32((d * sc) * c - dmin * mn) (quant/gguf_kquants.py), bit for bit
//   Q6_K   bf16(a * q)              per sub-block of 16: a = d * sc (fp32, exact: 11 + 7 bits),
//                                   q = code - 32 as int8; the product exact (at most 23 bits)
//   EXPANDED bf16(fmaf(a, q, b))    per 16 weights: q int8, (a, b) fp32 pairs, each part's format
//                                   written in this one form at upload (gpu/quant_weights.py's
//                                   expanded_fields): Q8_0 (d, q, -0), Q4_0 (d, c - 8, -0), Q4_1
//                                   (d, c, m), Q4_K (d * sc, c, -(dmin * mn)), Q6_K (d * sc, code - 32,
//                                   -0); a * q is exact in each, so the fmaf rounds as the part's twin
//                                   (b = -0 keeps a zero product's sign)
// A nibble block (Q4_K: a sub-block of 32, repacked at upload into Q4_0's byte order) is one lane's
// 16 bytes; its groups are: low nibbles of bytes 0..7 (k 0..7), of
// bytes 8..15 (k 8..15), high nibbles of bytes 0..7 (k 16..23), of bytes 8..15 (k 24..31).
//
// Device layout (gpu/quant_weights.py uploads it): a GGUF matrix is split into its quants plane
// [n][k * bits / 8] bytes (16-byte aligned rows: whole 16- or 32-byte runs per block) and its
// scales plane, the same bytes as the file's blocks in another order:
//   Q8_0, Q4_0   fp16 d [n][SB], SB = nb rounded up to even (nb = k / 32): a lane reads the
//                4-byte word holding its block's d (cp.async moves 4, 8 or 16 bytes)
//   Q4_1         (d, m) fp16 pairs [n][nb]: one word per block
//   FP8          the codes [n][k] and fp32 scale [n] (read in the epilogue)
//   Q4_K         nibbles [n][k / 2] (sub-block s's 32 codes as a Q4_0 block's 16 bytes) and fp32
//                (a, b) pairs [n][k / 32]: one 8-byte entry a lane (6 bits a weight: the file's 4.5
//                plus its 6-bit scales pre-multiplied into fp32 so a lane does one fmaf per weight)
//   Q6_K         int8 q [n][k] (the 6-bit codes widened: 10 bits a weight against the file's 6.56)
//                and fp32 a [n][k / 16]: one 4-byte entry a lane
//   EXPANDED     int8 q [n][k] and fp32 (a, b) pairs [n][k / 16] (12 bits a weight): a q/k/v or
//                gate/up group whose parts differ in format stays one matrix, so the fused epilogues
//                (qkv + RoPE + KV write, gate_up + SwiGLU) run on it unchanged
// Lane t's block in a step: Q8_0 kk / 32 + t / 2 (a lane holds half a block), Q4 kk / 32 + t;
// the fp32-scaled kinds' entry: Q4_K (kk + 32 t) / 32, Q6_K and EXPANDED (kk + 16 t) / 16.
//
// Launch shape (tinyvllm/gpu/ops/quant_gemv.py): grid.x = ceil(n / 16), block.x = 32 * kw (kw <=
// MAX_K_WARPS warps split K as in gemv.cu), shared = kw * (PARTIAL_BYTES + RING_STEPS * slot bytes
// of the format), plus the producer's row sums for a prenormed kernel (m * k / 16 * 4 bytes). Slots
// are larger than gemv.cu's (a step carries 32-64 bytes of X per lane), so the ring holds 3 steps
// and a CTA at most 16 warps, FP8's (the smallest slots) 32. Bounds: rows >= n, k >= K and X rows
// >= m are never read (zero-filled copies), k % LANE_K == 0 (FP8) or k % 32 == 0 (blocks); x, w
// 16-byte aligned.
// The entry points are gemv.cu's seven for each kind — plain (linear()), the residual GEMV that
// hands the next norm over, and the prenormed qkv + RoPE + KV write, LM head, gate_up + SwiGLU /
// GeGLU — so a quantized model runs the fused decode layer as a bf16 one does: the epilogues are
// gemv.cu's own (gemv_common.cuh), fed the same fp32 sums; FP8's row scale multiplies each sum
// first (before the handed-over norm's inv_rms).
// PDL: W (and scales) of the first RING_STEPS steps are copied before griddepcontrol.wait.
#include <cuda_fp8.h>
#include "common.cuh"

constexpr int ROWS_PER_CTA = 16;
constexpr int MAX_K_WARPS = 16;
constexpr int MAX_SHARED_BYTES = 232448;    // an sm_90 block's dynamic shared memory (227 KB, opted into)
// FP8's CTA may hold 32 warps: 32 x (512 + 3 x 2,048) = 212,992 bytes of rings, plus a prenormed
// kernel's row sums (2k bytes at m = 8), within MAX_SHARED_BYTES for k <= 8,192. At 16
// warps Llama-1B's down GEMV (128 CTAs, 8 steps a warp) kept 48 KB of W in flight an SM against
// bf16's 124 KB (gpu/ops/quant_gemv.py's quant_k_warps checks the budget for larger k).
constexpr int MAX_K_WARPS_FP8 = 32;
constexpr int RING_STEPS = 3;
constexpr int PARTIAL_BYTES = 512;           // a warp's 8 x 16 fp32 partial tile
// per-format ring slot of one warp: 2 W quads + X quads per lane (+ 2 scale words per lane)
constexpr int SLOT_BYTES_FP8 = 32 * 16 * 4;
constexpr int SLOT_BYTES_Q8_0 = 32 * 16 * 4 + 32 * 8;
constexpr int SLOT_BYTES_Q4 = 32 * 16 * 6 + 32 * 8;
constexpr int SLOT_BYTES_Q4_K = 32 * 16 * 6 + 32 * 16;      // fp32 (a, b) pairs: 8 bytes a lane and row
constexpr int SLOT_BYTES_Q6_K = SLOT_BYTES_Q8_0;               // one fp32 step a lane and row
constexpr int SLOT_BYTES_EXPANDED = 32 * 16 * 4 + 32 * 16;
static_assert(MAX_K_WARPS_FP8 * (PARTIAL_BYTES + RING_STEPS * SLOT_BYTES_FP8) + 2 * 8192 <= MAX_SHARED_BYTES,
              "FP8's widest CTA and its row sums fit an SM's shared memory up to k = 8,192");
constexpr int LANE_K_BYTE = 16;              // weights per lane-step: one-byte formats
constexpr int LANE_K_NIBBLE = 32;            // nibble formats (one whole block)

#include "gemv_common.cuh"   // mma_pair, the X load modes and the epilogues (shared with gemv.cu)

namespace {

enum class Fmt { fp8, q8_0, q4_0, q4_1, q4_k, q6_k, expanded };

template <Fmt F>
struct Format {
    static constexpr bool NIBBLES = F == Fmt::q4_0 || F == Fmt::q4_1 || F == Fmt::q4_k;
    static constexpr int LANE_K = NIBBLES ? LANE_K_NIBBLE : LANE_K_BYTE;
    static constexpr int STEP_K = 4 * LANE_K;
    static constexpr int X_QUADS = LANE_K / 8;
    static constexpr bool BLOCKS = F != Fmt::fp8;
    static constexpr int MAX_WARPS = F == Fmt::fp8 ? MAX_K_WARPS_FP8 : MAX_K_WARPS;
    static constexpr int SLOT_BYTES = F == Fmt::fp8 ? SLOT_BYTES_FP8 : F == Fmt::q8_0 ? SLOT_BYTES_Q8_0
                                    : F == Fmt::q4_k ? SLOT_BYTES_Q4_K : F == Fmt::q6_k ? SLOT_BYTES_Q6_K
                                    : F == Fmt::expanded ? SLOT_BYTES_EXPANDED : SLOT_BYTES_Q4;
    // the fp32-scaled kinds (module header): a scale entry per SCALE_K weights, WORDS 4-byte words
    // each (2: an (a, b) pair), read with one cp.async of 4 * WORDS bytes per lane and row
    static constexpr bool F32_SCALES = BLOCKS && (F == Fmt::q4_k || F == Fmt::q6_k || F == Fmt::expanded);
    static constexpr int SCALE_K = F == Fmt::q4_k ? 32 : 16;
    static constexpr int WORDS = F == Fmt::q6_k ? 1 : 2;
};

// 4-byte cp.async (.ca: the only kind below 16 bytes); src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Two e4m3 codes (the low 16 bits of `pair`, first code in the low byte) -> a bf16 pair, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack_bf16x2(f.x, f.y);
}

// 8-byte cp.async (.ca); src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Byte i of `flipped` (a word of int8 codes with each sign bit flipped: q + 128) -> q as f32,
// exactly, on the ALU pipes: 2^23 + (q + 128) is the float whose low mantissa bits are the byte,
// and subtracting 2^23 + 128 leaves q. An int8 cast compiles to I2F.S8, which issues on the
// conversion pipe (16 a clock an SM on sm_90, against 64 for PRMT and 128 for FADD); a Q8_0 /
// Q6_K lane-step converts 32 weights. (The nibble kinds' casts of a u32 compile to I2FP, an ALU
// instruction already.)
__device__ __forceinline__ float int8_as_float_exact(uint32_t flipped, int i) {
    return __int_as_float(__byte_perm(flipped, 0x4B000000u, 0x7540u | i)) - 8388736.f;   // 2^23 + 128
}

// The block's d (and Q4_1's m) from the lane's scale word.
struct BlockScale {
    float d, m;
};

template <Fmt F>
__device__ __forceinline__ BlockScale block_scale(uint32_t word, int block) {
    if constexpr (F == Fmt::q4_1) {
        const __half2 dm = *reinterpret_cast<const __half2*>(&word);
        return {__low2float(dm), __high2float(dm)};
    } else {
        const unsigned short bits = (block & 1) ? (word >> 16) : (word & 0xFFFFu);
        return {__half2float(__ushort_as_half(bits)), 0.f};
    }
}

// An fp32-scaled kind's (a, b) from its scale entry's words (Q6_K: (step, -0), its value step * q).
template <Fmt F>
__device__ __forceinline__ BlockScale f32_scale(const uint32_t* words) {
    if constexpr (Format<F>::WORDS == 2) return {__uint_as_float(words[0]), __uint_as_float(words[1])};
    else return {__uint_as_float(words[0]), -0.f};
}

// One 4-bit code -> its dequantized value, rounded once to f32 (the twins' formula).
template <Fmt F>
__device__ __forceinline__ float nibble_value(uint32_t code, const BlockScale& s) {
    if constexpr (F == Fmt::q4_1 || F == Fmt::q4_k) return __fmaf_rn(s.d, (float)code, s.m);
    else return __fmul_rn(s.d, (float)((int)code - 8));
}

// Group `j` (8 weights) of the lane's 16 weight bytes `w` as a bf16 quad (module header).
template <Fmt F>
__device__ __forceinline__ uint4 dequant_group(int j, const uint4& w, const BlockScale& s) {
    if constexpr (F == Fmt::fp8) {
        const uint32_t lo = j == 0 ? w.x : w.z, hi = j == 0 ? w.y : w.w;
        return {e4m3x2_to_bf16x2(lo), e4m3x2_to_bf16x2(lo >> 16), e4m3x2_to_bf16x2(hi), e4m3x2_to_bf16x2(hi >> 16)};
    } else if constexpr (F == Fmt::q8_0) {
        const uint32_t lo = (j == 0 ? w.x : w.z) ^ 0x80808080u, hi = (j == 0 ? w.y : w.w) ^ 0x80808080u;
        float v[8];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            v[b] = __fmul_rn(s.d, int8_as_float_exact(lo, b));
            v[4 + b] = __fmul_rn(s.d, int8_as_float_exact(hi, b));
        }
        return {pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7])};
    } else if constexpr (F == Fmt::q6_k || F == Fmt::expanded) {   // int8 q: a * q (+ b), rounded once
        const uint32_t lo = (j == 0 ? w.x : w.z) ^ 0x80808080u, hi = (j == 0 ? w.y : w.w) ^ 0x80808080u;
        float v[8];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const float q0 = int8_as_float_exact(lo, b), q1 = int8_as_float_exact(hi, b);
            v[b] = F == Fmt::q6_k ? __fmul_rn(s.d, q0) : __fmaf_rn(s.d, q0, s.m);
            v[4 + b] = F == Fmt::q6_k ? __fmul_rn(s.d, q1) : __fmaf_rn(s.d, q1, s.m);
        }
        return {pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7])};
    } else {
        const uint32_t lo = (j & 1) ? w.z : w.x, hi = (j & 1) ? w.w : w.y;
        const int shift = (j & 2) ? 4 : 0;   // groups 2, 3: the high nibbles
        float v[8];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            v[b] = nibble_value<F>((lo >> (8 * b + shift)) & 0xFu, s);
            v[4 + b] = nibble_value<F>((hi >> (8 * b + shift)) & 0xFu, s);
        }
        return {pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7])};
    }
}

// Four 4-bit codes (bytes 0..3 of `word`, each code in its byte's low nibble) -> two bf16 pairs
// holding 128 + c exactly (module header): PRMT spreads bytes (0, 1) and (2, 3) to the halves,
// one LOP3 keeps the nibbles and ors in 0x4300 (bf16 128, whose ulp is 1).
__device__ __forceinline__ uint2 biased_codes4(uint32_t word) {
    return {(__byte_perm(word, 0u, 0x3120u) & 0x000F000Fu) | 0x43004300u,
            (__byte_perm(word, 0u, 0x3322u) & 0x000F000Fu) | 0x43004300u};
}

// A nibble block's affine map w = a * c + b as the fold's (a, bias = fl32(b - 128 a)) from the
// lane's scale words: Q4_0 (d, -136 d: exact), Q4_1 (d, fmaf(-128, d, m)), Q4_K (a, fmaf(-128, a, b)).
template <Fmt F>
__device__ __forceinline__ BlockScale factored_scale(const uint32_t* words, int entry, int block) {
    if constexpr (F == Fmt::q4_k) {
        const BlockScale s = f32_scale<F>(words + 2 * entry);
        return {s.d, __fmaf_rn(-128.f, s.d, s.m)};
    } else {
        const BlockScale s = block_scale<F>(words[entry], block);
        return {s.d, F == Fmt::q4_0 ? -136.f * s.d : __fmaf_rn(-128.f, s.d, s.m)};
    }
}

// One lane-step of a nibble kind (module header, "The nibble kinds' factored product"): for each of
// the step's 4 blocks b, lane (g, t) takes group t of block b of rows row_a + g and row_b + g (8
// codes: nibble half t / 2 of bytes 8 (t % 2) .. + 7, as bf16 128 + c) and X quad t of the same block
// (X row g, written by lane (g, b)), so one mma pair sums one block of 32 into a fresh fragment;
// a second pair with A = 1 gives the block's X sums in the same fragment shape. Then
// acc += a * P + bias * S per row and X row: the block's affine map applied once, in fp32.
template <Fmt F>
__device__ __forceinline__ void factored_step(float acc[4], const uint4* slot, int g, int t) {
    using Q = Format<F>;
    const uint2* w2 = reinterpret_cast<const uint2*>(slot);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(slot + (2 + Q::X_QUADS) * 32);
    const int shift = 4 * (t >> 1);
    const uint4 ones = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};   // bf16 1.0 pairs
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const uint2 wp = w2[2 * (8 * b + g) + (t & 1)], wq = w2[2 * (32 + 8 * b + g) + (t & 1)];
        const uint2 p0 = biased_codes4(wp.x >> shift), p1 = biased_codes4(wp.y >> shift);
        const uint2 q0 = biased_codes4(wq.x >> shift), q1 = biased_codes4(wq.y >> shift);
        const uint4 x = slot[(2 + t) * 32 + 4 * g + b];
        float blk[4] = {0.f, 0.f, 0.f, 0.f}, sum[4] = {0.f, 0.f, 0.f, 0.f};
        mma_pair(blk, uint4{p0.x, p0.y, p1.x, p1.y}, uint4{q0.x, q0.y, q1.x, q1.y}, x);
        mma_pair(sum, ones, ones, x);
        // the scale entries of lane (g, b), which copied this block's (rows p and q: 32 entries apart)
        const BlockScale sp = factored_scale<F>(words, 4 * g + b, b), sq = factored_scale<F>(words, 32 + 4 * g + b, b);
        acc[0] = __fmaf_rn(sp.m, sum[0], __fmaf_rn(sp.d, blk[0], acc[0]));
        acc[1] = __fmaf_rn(sp.m, sum[1], __fmaf_rn(sp.d, blk[1], acc[1]));
        acc[2] = __fmaf_rn(sq.m, sum[2], __fmaf_rn(sq.d, blk[2], acc[2]));
        acc[3] = __fmaf_rn(sq.m, sum[3], __fmaf_rn(sq.d, blk[3], acc[3]));
    }
}

// y, x, and the epilogue's arguments as gemv.cu's gemv_body takes them (MODE, EPI, QKV_BIAS the
// same); wq: the codes / quants plane; wscale: FP8's fp32 [n] (applied to each output's sum in the
// epilogue, before the handed-over norm's inv_rms) or the blocks' scales plane (module header).
template <Fmt F, XLoad MODE, Epilogue EPI, bool QKV_BIAS = false>
__device__ __forceinline__ void gemv_quant_body(void* __restrict__ y, const bf16* __restrict__ x,
                                                const NormArgs& norm, const uint8_t* __restrict__ wq,
                                                const void* __restrict__ wscale, int m, int n, int k,
                                                int out_f32, int accumulate, const RopeArgs& rope,
                                                const NormOut& norm_out, unsigned long long* head_argmax = nullptr) {
    using Q = Format<F>;
    extern __shared__ float partial[];   // [warps][8][16] partial tiles, then the warps' rings, then
                                         // (prenormed) the producer's sums of squares [m][ss_count]
    allow_consumer();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const Tile w_tile = cta_tile<EPI>(blockIdx.x, n, rope.head_dim);   // the CTA's 16 W rows (gemv.cu)
    const int steps = (k + Q::STEP_K - 1) / Q::STEP_K;
    const int s_begin = warp * steps / warps, s_end = (warp + 1) * steps / warps;
    const int my_steps = s_end - s_begin;

    const bool w_ok0 = w_tile.row_a + g < n, w_ok1 = w_tile.row_b + g < n, x_ok = g < m;
    const int row0 = w_ok0 ? w_tile.row_a + g : 0, row1 = w_ok1 ? w_tile.row_b + g : 0;
    const size_t row_bytes = Q::NIBBLES ? (size_t)k / 2 : (size_t)k;
    const uint8_t* w0 = wq + row0 * row_bytes;
    const uint8_t* w1 = wq + row1 * row_bytes;
    const bf16* xr = x + (x_ok ? g : 0) * (size_t)k;
    hold(w0), hold(w1), hold(xr);
    // scale words per row: Q4_1 one per block; Q8_0 / Q4_0 one per two blocks (SB / 2)
    const int nb = k / 32;
    const int words_per_row = F == Fmt::q4_1 ? nb : (nb + 1) / 2;
    const uint32_t* s0 = static_cast<const uint32_t*>(wscale) + (size_t)row0 * words_per_row;
    const uint32_t* s1 = static_cast<const uint32_t*>(wscale) + (size_t)row1 * words_per_row;
    // the fp32-scaled kinds: k / SCALE_K entries of WORDS words a row
    const uint32_t* f0 = static_cast<const uint32_t*>(wscale) + (size_t)row0 * (k / Q::SCALE_K * Q::WORDS);
    const uint32_t* f1 = static_cast<const uint32_t*>(wscale) + (size_t)row1 * (k / Q::SCALE_K * Q::WORDS);

    uint4* const slots = reinterpret_cast<uint4*>(partial + warps * (PARTIAL_BYTES / 4)) +
                         warp * (RING_STEPS * Q::SLOT_BYTES / 16);
    // prenormed: the producer's m x ss_count row sums after every warp's ring, copied as gemv.cu
    // copies them (whole 16-byte chunks: k % 64 == 0, checked in Python)
    const int ss_count = (k + ROWS_PER_CTA - 1) / ROWS_PER_CTA;
    float* const producer_ss = partial + warps * (PARTIAL_BYTES / 4) + warps * (RING_STEPS * Q::SLOT_BYTES / 4);
    auto copy_producer_ss = [&]() {
        if constexpr (MODE == XLoad::prenormed) {
            for (int c = threadIdx.x; c < m * ss_count / 4; c += blockDim.x)
                cp_async16(smem_addr(producer_ss + 4 * c), norm.row_ss + 4 * c, 16);
        }
    };
    auto slot_of = [&](int i) { return slots + (i % RING_STEPS) * (Q::SLOT_BYTES / 16); };
    auto lane_k = [&](int i) { return (s_begin + i) * Q::STEP_K + Q::LANE_K * t; };
    auto block_of = [&](int kc) { return kc / 32; };
    auto copy_w = [&](int i) {   // weights and their scales: written by no kernel
        uint4* slot = slot_of(i);
        const int kc = lane_k(i);
        const bool in = kc < k;
        const size_t at = Q::NIBBLES ? (size_t)kc / 2 : (size_t)kc;
        const int pos = Q::NIBBLES ? 8 * t + g : lane;   // nibbles: block-major (factored_step)
        ring_copy(slot + pos, w0 + (in && w_ok0 ? at : 0), in && w_ok0 ? 16 : 0);
        ring_copy(slot + 32 + pos, w1 + (in && w_ok1 ? at : 0), in && w_ok1 ? 16 : 0);
        if constexpr (Q::F32_SCALES) {   // after the quads: row 0's entries, then row 1's
            uint32_t* words = reinterpret_cast<uint32_t*>(slot + (2 + Q::X_QUADS) * 32);
            const int word = kc / Q::SCALE_K * Q::WORDS;
            const bool ok0 = in && w_ok0, ok1 = in && w_ok1;
            if constexpr (Q::WORDS == 2) {
                cp_async8(smem_addr(words + 2 * lane), f0 + (ok0 ? word : 0), ok0 ? 8 : 0);
                cp_async8(smem_addr(words + 64 + 2 * lane), f1 + (ok1 ? word : 0), ok1 ? 8 : 0);
            } else {
                cp_async4(smem_addr(words + lane), f0 + (ok0 ? word : 0), ok0 ? 4 : 0);
                cp_async4(smem_addr(words + 32 + lane), f1 + (ok1 ? word : 0), ok1 ? 4 : 0);
            }
        } else if constexpr (Q::BLOCKS) {
            uint32_t* words = reinterpret_cast<uint32_t*>(slot + (2 + Q::X_QUADS) * 32);   // after the quads
            const int word = F == Fmt::q4_1 ? block_of(kc) : block_of(kc) / 2;
            cp_async4(smem_addr(words + lane), s0 + (in && w_ok0 ? word : 0), in && w_ok0 ? 4 : 0);
            cp_async4(smem_addr(words + 32 + lane), s1 + (in && w_ok1 ? word : 0), in && w_ok1 ? 4 : 0);
        }
    };
    auto copy_x = [&](int i) {
        uint4* slot = slot_of(i);
        const int kc = lane_k(i);
        const bool in = x_ok && kc < k;
#pragma unroll
        for (int j = 0; j < Q::X_QUADS; ++j)
            cp_async16(smem_addr(slot + (2 + j) * 32 + lane), in ? xr + kc + 8 * j : xr, in ? 16 : 0);
    };
    // gemv.cu's ring schedule: W of the first RING_STEPS steps before the wait, one group each,
    // X after it; then one group per step, so step i >= RING_STEPS has RING_STEPS - 1 after it.
#pragma unroll
    for (int i = 0; i < RING_STEPS; ++i) {
        if (i < my_steps) copy_w(i);
        cp_async_commit();
    }
    const void* x_src[RING_STEPS];
    int x_bytes[RING_STEPS];
    first_x_sources(xr, x_ok, my_steps, 0, k, lane_k, x_src, x_bytes);
    wait_for_producer();
#pragma unroll
    for (int i = 0; i < RING_STEPS; ++i)
#pragma unroll
        for (int j = 0; j < Q::X_QUADS; ++j)
            cp_async16(smem_addr(slot_of(i) + (2 + j) * 32 + lane), static_cast<const bf16*>(x_src[i]) + 8 * j,
                       x_bytes[i]);
    copy_producer_ss();    // in X's group: done by its wait below
    cp_async_commit();
    cp_async_wait<0>();

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < my_steps; ++i) {
        if (i >= RING_STEPS) cp_async_wait<RING_STEPS - 1>();
        const uint4* slot = slot_of(i);
        if constexpr (Q::NIBBLES) {
            factored_step<F>(acc, slot, g, t);
            if (i + RING_STEPS < my_steps) {
                copy_w(i + RING_STEPS);
                copy_x(i + RING_STEPS);
            }
            cp_async_commit();
            continue;
        }
        const uint4 p = slot[lane], q = slot[32 + lane];
        BlockScale sp{}, sq{};
        if constexpr (Q::F32_SCALES) {
            const uint32_t* words = reinterpret_cast<const uint32_t*>(slot + (2 + Q::X_QUADS) * 32);
            sp = f32_scale<F>(words + Q::WORDS * lane);
            sq = f32_scale<F>(words + Q::WORDS * (32 + lane));
        } else if constexpr (Q::BLOCKS) {
            const uint32_t* words = reinterpret_cast<const uint32_t*>(slot + (2 + Q::X_QUADS) * 32);
            const int block = block_of(lane_k(i));
            sp = block_scale<F>(words[lane], block);
            sq = block_scale<F>(words[32 + lane], block);
        }
#pragma unroll
        for (int j = 0; j < Q::X_QUADS; ++j)
            mma_pair(acc, dequant_group<F>(j, p, sp), dequant_group<F>(j, q, sq), slot[(2 + j) * 32 + lane]);
        if (i + RING_STEPS < my_steps) {
            copy_w(i + RING_STEPS);
            copy_x(i + RING_STEPS);
        }
        cp_async_commit();
    }

    if constexpr (MODE == XLoad::prenormed) cp_async_wait<0>();   // visible to all after __syncthreads

    // gemv.cu's partial tiles: lane (g, t) holds tile columns g and 8 + g of x rows 2t and 2t+1.
    float* mine = partial + warp * (PARTIAL_BYTES / 4) + 2 * t * ROWS_PER_CTA + g;
    mine[0] = acc[0];
    mine[ROWS_PER_CTA] = acc[1];
    mine[8] = acc[2];
    mine[ROWS_PER_CTA + 8] = acc[3];
    __syncthreads();
    gemv_epilogue<MODE, EPI, QKV_BIAS, F == Fmt::fp8>(partial, warps, y, m, n, k, out_f32, accumulate, norm.eps,
                                                      producer_ss, ss_count, rope, norm_out, head_argmax,
                                                      static_cast<const float*>(wscale));
}

// Prefill's dequantization (gpu/ops/quant_gemv.py): rows [row0, row0 + rows) of W as bf16 into
// out [rows, k], each value as the GEMV's registers hold it — the GGUF formats exactly so; FP8 as
// bf16(code * scale), one rounding the GEMV avoids by scaling its sum (the cuBLAS GEMM after it
// takes no per-row scale). One thread per 8 weights (one group), grid-stride.
template <Fmt F>
__device__ __forceinline__ void dequant_body(bf16* __restrict__ out, const uint8_t* __restrict__ wq,
                                             const void* __restrict__ wscale, int row0, int rows, int k) {
    using Q = Format<F>;
    allow_consumer();
    wait_for_producer();   // out may still be read by the GEMM of the projection before
    const int groups_per_row = k / 8;
    const size_t total = (size_t)rows * groups_per_row;
    const size_t row_bytes = Q::NIBBLES ? (size_t)k / 2 : (size_t)k;
    const int nb = k / 32, words_per_row = F == Fmt::q4_1 ? nb : (nb + 1) / 2;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / groups_per_row), kg = (int)(i % groups_per_row) * 8;   // the group's first k
        const size_t row = (size_t)row0 + r;
        // the lane chunk (16 bytes) holding this group, and the group's index inside it
        const int chunk_k = kg / Q::LANE_K * Q::LANE_K;
        const uint4 w = *reinterpret_cast<const uint4*>(wq + row * row_bytes + (Q::NIBBLES ? chunk_k / 2 : chunk_k));
        const int j = (kg - chunk_k) / 8;
        uint4 values;
        if constexpr (F == Fmt::fp8) {
            const float scale = static_cast<const float*>(wscale)[row];
            float v[8];
            unpack_bf16x8(dequant_group<F>(j, w, BlockScale{}), v);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], scale);
            values = {pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7])};
        } else if constexpr (Q::F32_SCALES) {
            const uint32_t* words = static_cast<const uint32_t*>(wscale) + row * (k / Q::SCALE_K * Q::WORDS) +
                                    kg / Q::SCALE_K * Q::WORDS;
            values = dequant_group<F>(j, w, f32_scale<F>(words));
        } else {
            const int block = kg / 32;
            const uint32_t word = static_cast<const uint32_t*>(wscale)[row * words_per_row +
                                                                      (F == Fmt::q4_1 ? block : block / 2)];
            values = dequant_group<F>(j, w, block_scale<F>(word, block));
        }
        *reinterpret_cast<uint4*>(out + (size_t)r * k + kg) = values;
    }
}

}  // namespace

// The entry points: gemv.cu's seven, one set per kind (QUANT_GEMV_KERNELS(kind): gemv_quant_<role>_<kind>,
// the kind also naming its Fmt), with W as its two planes (wq, wscale) in the bf16 kernel's w place;
// each means what its gemv.cu namesake means (there: the argument lists). Then prefill's
// dequantization of rows [row0, row0 + rows) into out [rows, k] bf16 (dequant_<kind>).

#define QUANT_GEMV_KERNELS(K) \
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_##K(void* __restrict__ y, const bf16* __restrict__ x, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, int out_f32, \
          int accumulate) { \
    gemv_quant_body<Fmt::K, XLoad::plain, Epilogue::store>(y, x, NormArgs{}, wq, wscale, m, n, k, out_f32, accumulate, \
                                                        RopeArgs{}, NormOut{}); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_residual_norm_##K(bf16* __restrict__ y, const bf16* __restrict__ x, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, \
                          const bf16* __restrict__ norm_w, bf16* __restrict__ normed, float* __restrict__ row_ss) { \
    gemv_quant_body<Fmt::K, XLoad::plain, Epilogue::residual_norm>(y, x, NormArgs{}, wq, wscale, m, n, k, 0, 1, \
                                                                RopeArgs{}, NormOut{norm_w, normed, row_ss}); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_prenormed_rope_kv_##K(bf16* __restrict__ qkv, const bf16* __restrict__ x, const float* __restrict__ row_ss, \
                              const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, float eps, bf16* k_cache, bf16* v_cache, \
                              const int* __restrict__ positions, const int* __restrict__ slot_mapping, \
                              const float* __restrict__ inv_freq, int num_q_heads, int num_kv_heads, int head_dim) { \
    gemv_quant_body<Fmt::K, XLoad::prenormed, Epilogue::rope_kv>( \
        qkv, x, NormArgs{eps, row_ss}, wq, wscale, m, n, k, 0, 0, \
        RopeArgs{k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim, nullptr}, \
        NormOut{}); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_prenormed_rope_kv_bias_##K(bf16* __restrict__ qkv, const bf16* __restrict__ x, \
                                   const float* __restrict__ row_ss, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, float eps, \
                                   bf16* k_cache, bf16* v_cache, const int* __restrict__ positions, \
                                   const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq, \
                                   int num_q_heads, int num_kv_heads, int head_dim, const bf16* __restrict__ bias) { \
    gemv_quant_body<Fmt::K, XLoad::prenormed, Epilogue::rope_kv, true>( \
        qkv, x, NormArgs{eps, row_ss}, wq, wscale, m, n, k, 0, 0, \
        RopeArgs{k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim, bias}, \
        NormOut{}); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_prenormed_##K(void* __restrict__ y, const bf16* __restrict__ x, const float* __restrict__ row_ss, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, \
                      int m, int n, int k, float eps, int out_f32, unsigned long long* __restrict__ head_argmax) { \
    gemv_quant_body<Fmt::K, XLoad::prenormed, Epilogue::store>(y, x, NormArgs{eps, row_ss}, wq, wscale, m, n, k, \
                                                            out_f32, 0, RopeArgs{}, NormOut{}, head_argmax); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_prenormed_silu_mul_##K(bf16* __restrict__ act, const bf16* __restrict__ x, \
                               const float* __restrict__ row_ss, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, float eps) { \
    gemv_quant_body<Fmt::K, XLoad::prenormed, Epilogue::silu_mul>(act, x, NormArgs{eps, row_ss}, wq, wscale, m, n, k, \
                                                               0, 0, RopeArgs{}, NormOut{}); \
} \
\
extern "C" __global__ void __launch_bounds__(Format<Fmt::K>::MAX_WARPS * 32) \
gemv_quant_prenormed_gelu_mul_##K(bf16* __restrict__ act, const bf16* __restrict__ x, \
                               const float* __restrict__ row_ss, const uint8_t* __restrict__ wq, const void* __restrict__ wscale, int m, int n, int k, float eps) { \
    gemv_quant_body<Fmt::K, XLoad::prenormed, Epilogue::gelu_mul>(act, x, NormArgs{eps, row_ss}, wq, wscale, m, n, k, \
                                                               0, 0, RopeArgs{}, NormOut{}); \
} \
\
extern "C" __global__ void dequant_##K(bf16* __restrict__ out, const uint8_t* __restrict__ wq, \
                                     const void* __restrict__ wscale, int row0, int rows, int k) { \
    dequant_body<Fmt::K>(out, wq, wscale, row0, rows, k); \
}

QUANT_GEMV_KERNELS(fp8)
QUANT_GEMV_KERNELS(q8_0)
QUANT_GEMV_KERNELS(q4_0)
QUANT_GEMV_KERNELS(q4_1)
QUANT_GEMV_KERNELS(q4_k)
QUANT_GEMV_KERNELS(q6_k)
QUANT_GEMV_KERNELS(expanded)
