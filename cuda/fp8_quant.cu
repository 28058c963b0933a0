// Per-token FP8 quantization of a projection's input, the first half of the W8A8 GEMM that runs an
// FP8 projection of more than 8 rows (gpu/ops/quant_gemv.py; the GEMM: gpu/cublaslt.py):
//   scale[r]    = fl32(amax_c |X[r, c]| / 448)           (1 for a row of zeros)
//   codes[r, c] = e4m3_rne(clamp(fl32(X[r, c] / scale[r]), -448, 448))
// X bf16 [m, k] row-major; codes uint8 [m, k] (e4m3 bytes), scales float32 [m]. The twin is
// quant/fp8.py's quantize_rows_e4m3, bit for bit for finite X: bf16 -> fp32 is exact, the max is
// exact in any order (fmaxf passes a NaN over, as the twin's np.fmax), the quotient is IEEE
// division (__fdiv_rn, numpy's float32 division) and __nv_cvt_float_to_fp8 rounds to nearest even
// as ml_dtypes does. The clamp matters only where fl32(amax / 448) rounded down, putting the row's
// largest quotient a little above 448; __NV_SATFINITE would saturate it the same way.
// Launch: one CTA of QUANT_ROW_THREADS per row; each thread reads 8 bf16 (16 bytes) a step, the
// row twice (the max, then the codes; the second read hits L1/L2). Requires k % 8 == 0 (an FP8
// matrix's k is a multiple of 16: gpu/quant_weights.py). X is the previous kernel's output: no
// __restrict__ on it (no .nc loads above the PDL wait).
#include <cuda_fp8.h>
#include "common.cuh"

constexpr int QUANT_ROW_THREADS = 256;
constexpr float E4M3_MAX = 448.0f;

__device__ __forceinline__ uint32_t e4m3x4(const float v[4], float scale) {
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float q = fminf(fmaxf(__fdiv_rn(v[i], scale), -E4M3_MAX), E4M3_MAX);
        packed |= (uint32_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3) << (8 * i);
    }
    return packed;
}

extern "C" __global__ void __launch_bounds__(QUANT_ROW_THREADS)
quantize_rows_e4m3(uint8_t* __restrict__ codes, float* __restrict__ scales, const bf16* x, int m, int k) {
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.x;
    if (r >= m) return;
    const bf16* row = x + (size_t)r * k;
    float amax = 0.0f;
    for (int c = threadIdx.x * 8; c < k; c += QUANT_ROW_THREADS * 8) {
        float v[8];
        load_bf16x8(row + c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    __shared__ float warp_amax[QUANT_ROW_THREADS / 32];
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = warp_amax[0];
#pragma unroll
    for (int w = 1; w < QUANT_ROW_THREADS / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
    const float scale = amax > 0.0f ? __fdiv_rn(amax, E4M3_MAX) : 1.0f;
    if (threadIdx.x == 0) scales[r] = scale;
    uint8_t* out = codes + (size_t)r * k;
    for (int c = threadIdx.x * 8; c < k; c += QUANT_ROW_THREADS * 8) {
        float v[8];
        load_bf16x8(row + c, v);
        *reinterpret_cast<uint2*>(out + c) = make_uint2(e4m3x4(v, scale), e4m3x4(v + 4, scale));
    }
}
