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
__device__ __forceinline__ void wait_for_producer() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_consumer() { asm volatile("griddepcontrol.launch_dependents;" :::); }

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

// Sum over the whole block; every thread gets the result. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float x) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_sum(x);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    x = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
    return warp_sum(x);
}

// ---- RMSNorm and SwiGLU arithmetic, shared by the standalone kernels and the fused GEMV --------
// gemv.cu fuses rms_norm into the qkv / gate_up GEMV's X load and silu_mul into the down GEMV's.
// The fused kernels produce the same bits as the unfused pair because both sides call these
// functions: the same operations in the same order, with the roundings written out (__fmaf_rn,
// __fmul_rn, ...) so that no contraction choice of the compiler can differ between the files.

// rms_norm's sum of squares of one row is a block_sum over NORM_THREADS threads in which thread
// vt first sums, in this order, the chunks c = 8 vt, 8 vt + 8 NORM_THREADS, ... (8 values each,
// in order). The fused GEMV replays exactly this tree (gemv.cu's cta_inv_rms).
constexpr int NORM_THREADS = 256;

// One chunk's step of that sum: sum_sq += v0^2, then v1^2, ... v7^2 (fma, in order).
__device__ __forceinline__ float norm_add_chunk(float sum_sq, const uint4& raw) {
    float v[8];
    unpack_bf16x8(raw, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_sq = __fmaf_rn(v[i], v[i], sum_sq);
    return sum_sq;
}

__device__ __forceinline__ float norm_partial_sum(const bf16* row, int hidden, int vt) {
    float sum_sq = 0.0f;
    for (int c = vt * 8; c < hidden; c += NORM_THREADS * 8) sum_sq = norm_add_chunk(sum_sq, load_fresh(row + c));
    return sum_sq;
}

__device__ __forceinline__ float norm_inv_rms(float sum_sq, int hidden, float eps) {
    return rsqrtf(__fadd_rn(__fdiv_rn(sum_sq, (float)hidden), eps));
}

// One normalised value before its bf16 rounding: (x * inv_rms) * weight.
__device__ __forceinline__ float norm_apply(float x, float inv_rms, float weight) {
    return __fmul_rn(__fmul_rn(x, inv_rms), weight);
}

// silu(gate) * up before its bf16 rounding: gate / (1 + e^-gate) * up. Fast intrinsics: __expf
// (ex2.approx, 2 ulp + 2^-21 relative near 0) and __fdividef (rcp.approx then a multiply, 2 ulp),
// far below the 2^-9 of the bf16 rounding that follows; IEEE division's slow-path call would
// cost the fused GEMV registers it does not have. For gate < -88, e^-gate = inf and gate * 0 =
// -0, the right limit (__fdividef's 0 for divisors in (2^126, 2^128) is the same limit).
__device__ __forceinline__ float silu_times(float gate, float up) {
    return __fmul_rn(__fdividef(gate, __fadd_rn(1.0f, __expf(-gate))), up);
}
