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
