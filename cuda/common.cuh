// Shared helpers for tinyvllm kernels: bf16 storage, fp32 math, 16-byte vector access, reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

// Programmatic dependent launch (PDL, gpu/kernels.py). Launched with the programmatic-stream-
// serialization attribute, a kernel may start while the kernel before it in the stream is still
// running. wait_for_producer() blocks until that kernel has finished and its writes are visible:
// every kernel calls it before reading anything an earlier kernel wrote (and before writing
// anything an earlier kernel may still read). allow_consumer() lets the next kernel start
// launching once every block of this one has called it (or exited). Both are no-ops in an
// ordinary launch. A kernel file that uses wait_for_producer() is what marks its kernels as
// safe to launch with the attribute.
// Every kernel calls allow_consumer() first thing: the wait, not the trigger, orders memory
// (griddepcontrol.wait returns only when every earlier grid has completed and its writes are
// visible), so an early trigger only lets the next kernel's blocks become resident sooner and
// run what they do before their wait — the GEMVs' weight copies, the decode attention's early
// K/V copies, none of which reads anything a kernel of the step writes. A chain of kernels may
// then be resident at once, each waiting on the one before; a kernel launches only once every
// block of the one before it is running, so the oldest is never starved of room. Triggering
// after the wait instead kept the next GEMV's weight stream behind the whole of a 1-block RMSNorm
// (H200, 2026-12-04, 273a945).
__device__ __forceinline__ void wait_for_producer() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_consumer() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// An empty asm that the compiler front end must treat as redefining v: v is computed where this
// stands and kept, not recomputed at a later use. The GEMV holds its row pointers and its first X
// copies' sources this way; recomputed inside the ring loop and after the PDL wait (from the
// block index up) they cost ~1 us a decode layer on Llama-1B (gemv.cu's header).
template <typename T>
__device__ __forceinline__ void hold(T*& v) { asm volatile("" : "+l"(v)); }
__device__ __forceinline__ void hold(int& v) { asm volatile("" : "+r"(v)); }

// ---- cp.async: 16-byte global -> shared copies that land while the thread goes on -------------
// Used by the decode attention's K/V rings and the GEMV's weight ring. A thread's copies become
// visible to that thread at cp_async_wait<N>() (N = groups it may leave in flight); other threads
// of the warp see them after a __syncwarp as well.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// src_bytes = 0 writes 16 zero bytes and reads nothing (rows past an end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}
// cp_async16 into a ring slot with the .L2::256B prefetch hint: L2 fetches the whole 256-byte
// sector group the 16 bytes lie in, which the lane's next steps read (the GEMV's weight ring,
// gemv.cu's header).
__device__ __forceinline__ void ring_copy(uint4* slot, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
                 ::"r"(smem_addr(slot)), "l"(src), "r"(src_bytes) : "memory");
}

// ---- tensor cores: the one mma shape every kernel uses ---------------------------------------
// c (16 x 8 fp32) += A (16 x 16 bf16) * B (16 x 8 bf16): mma.sync m16n8k16, A = {a0, a1, a2, a3}
// and B = {b0, b1} in PTX's fragment layout, each register a bf16 pair. Every lane of the warp
// executes it together (mma.sync.aligned), so its callers keep it warp-uniform.
__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight bf16 values: the unit of one 16-byte load or store.
struct alignas(16) bf16x8 {
    __nv_bfloat162 pair[4];
};

// Widen eight bf16 values held in a 16-byte register quad (kept raw while loads are in flight).
__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float out[8]) {
    const bf16x8 v = *reinterpret_cast<const bf16x8*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v.pair[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load_bf16x8(const bf16* src, float out[8]) {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(src), out);
}

// Eight bf16 values an earlier kernel wrote: a plain (coherent, never .nc) load that asm volatile
// keeps after wait_for_producer() whatever the pointer's qualifiers.
__device__ __forceinline__ uint4 load_fresh(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Two floats rounded to bf16 (nearest even) and packed as one 32-bit word, lo in the low half:
// the memory order of store_bf16x8, so a packed quad equals what a load of the stored row gives.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ void store_bf16x8(bf16* dst, const float in[8]) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.pair[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<bf16x8*>(dst) = v;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// ---- a row's sum of squares, 16 columns at a time ---------------------------------------------
// rms_norm (rmsnorm.cu) sums a row's squares as chunk sums of SS_CHUNK columns, and the embedding's
// handed-over norm (embedding.cu) stores such chunk sums for the GEMV after it: one tree for both.
constexpr int SS_CHUNK = 16;   // columns per chunk of the sum of squares

// The chunk tree over v[0..15] (missing columns are 0): pairs (j, j+8), then (j, j+4), (j, j+2),
// (0, 1).
__device__ __forceinline__ float chunk_sum_sq(const float v[SS_CHUNK]) {
    float s[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j] = __fadd_rn(__fmul_rn(v[j], v[j]), __fmul_rn(v[j + 8], v[j + 8]));
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = __fadd_rn(s[j], s[j + 4]);
#pragma unroll
    for (int j = 0; j < 2; ++j) s[j] = __fadd_rn(s[j], s[j + 2]);
    return __fadd_rn(s[0], s[1]);
}

// The handed-over norm's share of one SS_CHUNK-column chunk of a new residual row h (a kernel
// that writes the residual stream hands the next RMSNorm over to the GEMV after it): the chunk's
// sum of squares into *ss and the next norm's operand bf16(h * (weight_offset + w)) into normed.
__device__ __forceinline__ void hand_over_norm_chunk(const float h[SS_CHUNK], const bf16* weight, float weight_offset,
                                                     bf16* normed, float* ss) {
    float w[SS_CHUNK];
    *ss = chunk_sum_sq(h);
#pragma unroll
    for (int half = 0; half < 2; ++half) load_bf16x8(weight + 8 * half, w + 8 * half);
#pragma unroll
    for (int i = 0; i < SS_CHUNK; ++i) w[i] = __fmul_rn(h[i], __fadd_rn(w[i], weight_offset));
    store_bf16x8(normed, w);
    store_bf16x8(normed + 8, w + 8);
}

// An RMSNorm's arithmetic (rmsnorm.cu's kernels and the q/k norm of rope_kv.cu): inv_rms from a
// row's sum of squares, and one normalised value before its bf16 rounding, (x * inv_rms) * weight.
__device__ __forceinline__ float norm_inv_rms(float sum_sq, int hidden, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(sum_sq, (float)hidden), eps));
}
__device__ __forceinline__ float norm_apply(float x, float inv_rms, float weight) {
    return __fmul_rn(__fmul_rn(x, inv_rms), weight);
}

// ---- greedy argmax as one 64-bit key per value -----------------------------------------------
// The sampler's first pass (sampling.cu) finds each row's max logit, its lowest index among equal
// values, and whether the row is broken (a NaN or +inf, or nothing finite). The decode LM head
// (gemv.cu's gemv_prenormed_bf16) finds the same while it stores the logits: every output becomes
// one key, (ordered bits of the value) << 32 | (0xFFFFFFFF - index), and the row's largest key,
// kept by atomicMax, holds the max and its lowest index; the sampler then reads one word instead
// of the row. NaN (either sign) maps to the largest key, so a row with one is seen as broken, as
// +inf is (its key comes next); -0 maps to +0, which float comparison calls equal.
// reference/sampling.py's head_argmax_keys is the twin.

// A float's bits remapped so that unsigned integer order is float order (negatives too):
// reference/sampling.py's ordered_keys. For e >= 0 the plain bits already are.
__device__ __forceinline__ unsigned ordered_key(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_key(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
    const unsigned bits = v != v ? 0xffffffffu : ordered_key(v == 0.0f ? 0.0f : v);
    return (unsigned long long)bits << 32 | (0xffffffffu - (unsigned)index);
}
// The row's largest key read back: max value and index; broken (NaN, +inf, or no finite value)
// as sampling.cu's finish_row_argmax has it.
__device__ __forceinline__ bool decode_argmax_key(unsigned long long key, float& best_val, int& best_idx) {
    const unsigned bits = (unsigned)(key >> 32);
    best_val = from_ordered_key(bits);
    best_idx = (int)(0xffffffffu - (unsigned)key);
    constexpr unsigned POS_INF_KEY = 0xff800000u, NEG_INF_KEY = 0x007fffffu;   // ordered_key(+inf), (-inf)
    return bits >= POS_INF_KEY || bits <= NEG_INF_KEY;
}

// ---- RoPE, SwiGLU and GeGLU arithmetic, shared by the standalone kernels and the fused GEMVs -----
// At decode gemv.cu folds RoPE with the KV-cache write into the qkv GEMV's epilogue and silu_mul
// into the gate_up GEMV's epilogue; a fused kernel gives the bits of the kernels it replaces
// because both sides call these functions: the same operations in the same order, the roundings
// written out (__fmul_rn, __fadd_rn, ...) so that no contraction choice of the compiler can differ
// between files. (The RMSNorm those GEMVs take inside has its own formula, scale out of the dot
// product: gemv.cu's header; the standalone rms_norm's arithmetic is rmsnorm.cu's own.)

// The value a bf16 store then load gives: the GEMV's output as the next kernel would read it.
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

// RoPE of one (x1, x2) = (x[i], x[i + head_dim / 2]) pair at position pos, before the bf16
// rounding: the angle pos * inv_freq[i] in fp32 with the full-range sincosf (positions reach
// 131072), then the rotation with its products and sums rounded one by one.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float pos, float inv_freq, float& y1, float& y2) {
    float sin_a, cos_a;
    sincosf(__fmul_rn(pos, inv_freq), &sin_a, &cos_a);
    y1 = __fsub_rn(__fmul_rn(x1, cos_a), __fmul_rn(x2, sin_a));
    y2 = __fadd_rn(__fmul_rn(x2, cos_a), __fmul_rn(x1, sin_a));
}

// silu(gate) * up before its bf16 rounding: gate / (1 + e^-gate) * up. Fast intrinsics: __expf
// (ex2.approx, 2 ulp + 2^-21 relative near 0) and __fdividef (rcp.approx then a multiply, 2 ulp),
// far below the 2^-9 of the bf16 rounding that follows; IEEE division's slow-path call would
// cost the fused GEMV registers it does not have. For gate < -88, e^-gate = inf and gate * 0 =
// -0, the right limit (__fdividef's 0 for divisors in (2^126, 2^128) is the same limit).
__device__ __forceinline__ float silu_times(float gate, float up) {
    return __fmul_rn(__fdividef(gate, __fadd_rn(1.0f, __expf(-gate))), up);
}

// gelu_tanh(gate) * up before its bf16 rounding (Gemma 3's GeGLU, torch's gelu(approximate="tanh")):
// gelu_tanh(x) = x (1 + tanh(v)) / 2 = x / (1 + e^(-2v)), v = sqrt(2/pi) (x + 0.044715 x^3), the
// form without 1 + tanh(v)'s cancellation for very negative v (reference/kernels.py's
// gelu_tanh_mul, whose order of operations this keeps). The fast intrinsics as silu_times: for
// v < -44, e^(-2v) = inf and the quotient is -0, the right limit.
__device__ __forceinline__ float gelu_tanh_times(float gate, float up) {
    const float cube = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, gate), gate), gate);
    const float v = __fmul_rn(0.7978845608028654f, __fadd_rn(gate, cube));
    return __fmul_rn(__fdividef(gate, __fadd_rn(1.0f, __expf(__fmul_rn(-2.0f, v)))), up);
}

// ---- tensor-core attention tiles (attention_prefill.cu, attention_cascade.cu) ----------------
// ldmatrix: volatile + memory: the same shared address is read every tile; it must not be hoisted
// or merged.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// 2^x on the SFU (ex2.approx.ftz); 2^-inf = +0, which a softmax's first tile relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t load_u32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The A fragments of a 16-row tile of queries for all DK chunks of 16 head dims: rows g (from q0)
// and g + 8 (from q1) of the lane, each pointer at the row's head start + 2t; a row that is not
// there (ok0 / ok1 false) is zeros.
template <int DK>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[DK][4], const bf16* q0, const bf16* q1, bool ok0,
                                                 bool ok1) {
#pragma unroll
    for (int c = 0; c < DK; ++c) {
        qf[c][0] = ok0 ? load_u32(q0 + 16 * c) : 0u;
        qf[c][1] = ok1 ? load_u32(q1 + 16 * c) : 0u;
        qf[c][2] = ok0 ? load_u32(q0 + 16 * c + 8) : 0u;
        qf[c][3] = ok1 ? load_u32(q1 + 16 * c + 8) : 0u;
    }
}

// S = Q K^T for one key tile: s[n] (zeroed here) over NT n-tiles of 8 keys, the query rows' A
// fragments qf held in registers (DK of them, 16 head dims each) and the tile's keys in shared
// memory, key row r at k_frag + 2 * (ROW * r + 16 c) for head-dim chunk c (the lane's ldmatrix
// address of the first 16 keys is k_frag; ROW: the tile's row stride in bf16).
template <int NT, int DK, int ROW>
__device__ __forceinline__ void score_tile(float (&s)[NT][4], const uint32_t (&qf)[DK][4], uint32_t k_frag) {
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < DK; ++c) {
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            uint32_t b[4];
            ldmatrix_x4(b, k_frag + (16 * j * ROW + 16 * c) * 2);
            mma_bf16(s[2 * j], qf[c][0], qf[c][1], qf[c][2], qf[c][3], b[0], b[1]);
            mma_bf16(s[2 * j + 1], qf[c][0], qf[c][1], qf[c][2], qf[c][3], b[2], b[3]);
        }
    }
}

// One key tile of the online softmax on an m16n8k16 tile of query rows: each lane holds rows g
// and g + 8 (lane = 4 g + t). rescale_rows multiplies the output accumulators o[n] (c0 c1: row
// g, c2 c3: row g + 8) by the rows' alpha = 2^(old max - new max); softmax_to_fragments turns
// the scores s[n] into p = 2^(s * scale_log2 - offset) (offset: the row's new max times
// scale_log2), adds them to the rows' sums, and packs them as bf16 A fragments for P @ V, one
// per 16 keys: n-tile 2j -> a0 a1 of p[j], 2j + 1 -> a2 a3.
template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float alpha[2]) {
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
    }
}
template <int NT>
__device__ __forceinline__ void softmax_to_fragments(const float (&s)[NT][4], float scale_log2, const float offset[2],
                                                     float row_sum[2], uint32_t (&p)[NT / 2][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const float p0 = fast_exp2(fmaf(s[n][0], scale_log2, -offset[0]));
        const float p1 = fast_exp2(fmaf(s[n][1], scale_log2, -offset[0]));
        const float p2 = fast_exp2(fmaf(s[n][2], scale_log2, -offset[1]));
        const float p3 = fast_exp2(fmaf(s[n][3], scale_log2, -offset[1]));
        row_sum[0] += p0 + p1;
        row_sum[1] += p2 + p3;
        p[n / 2][(n & 1) * 2] = pack_bf16x2(p0, p1);
        p[n / 2][(n & 1) * 2 + 1] = pack_bf16x2(p2, p3);
    }
}
