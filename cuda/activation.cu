// Gated activations over the fused gate_up projection row, which holds gate in columns
// [0, inter) and up in [inter, 2 * inter):
//   silu_mul       out[t, i] = silu(gate[t, i]) * up[t, i]           (SwiGLU: Llama, Mistral, Qwen)
//   gelu_tanh_mul  out[t, i] = gelu_tanh(gate[t, i]) * up[t, i]      (GeGLU: Gemma 3)
// common.cuh's silu_times / gelu_tanh_times, which the gate_up GEMV's fused epilogues also call.
// Launch: grid-stride over num_tokens * inter / 8 chunks of 8 values. Requires inter % 8 == 0.
// gate_up is the previous kernel's output: no __restrict__ (no .nc loads above the PDL wait).
#include "common.cuh"

constexpr int THREADS = 256;   // block size (gpu/ops/rowwise.py launches with it)

template <bool GELU>
__device__ __forceinline__ void gated_activation(bf16* __restrict__ out, const bf16* gate_up, int num_tokens, int inter) {
    allow_consumer();
    wait_for_producer();
    const int chunks_per_row = inter / 8;
    const size_t total = (size_t)num_tokens * chunks_per_row;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t t = idx / chunks_per_row;
        const int c = (int)(idx % chunks_per_row) * 8;
        float g[8], u[8];
        load_bf16x8(gate_up + t * 2 * inter + c, g);
        load_bf16x8(gate_up + t * 2 * inter + inter + c, u);
#pragma unroll
        for (int i = 0; i < 8; ++i) g[i] = GELU ? gelu_tanh_times(g[i], u[i]) : silu_times(g[i], u[i]);
        store_bf16x8(out + t * inter + c, g);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) silu_mul(bf16* __restrict__ out, const bf16* gate_up,
                                    int num_tokens, int inter) {
    gated_activation<false>(out, gate_up, num_tokens, inter);
}

extern "C" __global__ void __launch_bounds__(THREADS) gelu_tanh_mul(bf16* __restrict__ out, const bf16* gate_up,
                                    int num_tokens, int inter) {
    gated_activation<true>(out, gate_up, num_tokens, inter);
}
