// What a kernel boundary costs inside a decode graph, and what a counter in global memory costs
// instead: a stub kernel for benchmarks/handoff_bench.py, with the engine's handoff helpers.
//
// A chain of stages, each a grid that needs ALL of the previous stage's output, the way every
// kernel of the decode layer does (a GEMV reads the whole x row, the attention the whole q/k/v of
// its kv head). Each block reads the `width` floats of `in`, streams `weight_quads` 16-byte
// quads of weights of its own (0: none), and writes its slice of `out`. Blocks from busy_blocks
// on leave at once (and count themselves done), like the decode attention's splits that a short
// context does not use. The handoff is one of:
//   griddepcontrol.wait (wait_counter = null): the engine's way today. Under programmatic
//     dependent launch the stage is resident early (allow_consumer first thing) and waits for the
//     whole previous grid to complete and flush (common.cuh).
//   a counter (wait_counter != null): the engine's TINYVLLM_HANDOFF=counter, with its helpers
//     (common.cuh's handoff_wait / handoff_done: each warp's lane 0 polls the producer's counter
//     with acquire loads until it holds the producer's block count; each block, its stores
//     done, syncs and bumps its own with a release reduction; block 0 zeroes the counter two
//     stages back), wired by gpu/handoff.py's counter_plan.
#include <math_constants.h>
#include "common.cuh"

namespace {

constexpr int UNROLL = 4;   // weight quads in flight per thread

__device__ __forceinline__ uint4 load_weight(const uint4* p) {   // read once, past L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

}  // namespace

extern "C" __global__ void handoff_stage(float* out, const float* in, int width, const uint4* weights,
                                         int weight_quads, const unsigned* wait_counter, unsigned wait_count,
                                         unsigned* done_counter, unsigned* reset_counter, int busy_blocks) {
    allow_consumer();
    const Handoff handoff{wait_counter, wait_count, done_counter, reset_counter};
    if ((int)blockIdx.x >= busy_blocks) {   // as the decode attention's unused splits do
        handoff_done(handoff);
        return;
    }
    // The first UNROLL weight quads before the handoff (as the GEMVs fill their rings), the rest after.
    const uint4* w = weights + (size_t)blockIdx.x * weight_quads;
    unsigned folded = 0;   // every weight bit reaches the output, so no load is dead code
    uint4 early[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        early[u] = i < weight_quads ? load_weight(w + i) : make_uint4(0u, 0u, 0u, 0u);
    }

    handoff_wait(handoff);

    // All of the previous stage's output, through L2 (other SMs wrote it): every value must equal
    // in[0], and this thread's output is in[0] + 1 (NaN if not), so a block that read too early
    // (a stale value of the replay before) poisons the end of the chain (handoff_bench.py checks).
    const float first = __ldcg(in);
    bool same = true;
    for (int i = threadIdx.x; i < width; i += blockDim.x) same &= __ldcg(in + i) == first;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) folded ^= early[u].x ^ early[u].y ^ early[u].z ^ early[u].w;
    for (int i0 = threadIdx.x + UNROLL * blockDim.x; i0 < weight_quads; i0 += UNROLL * blockDim.x) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < weight_quads ? load_weight(w + i) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    // the weights are zeros: `folded` only keeps their loads alive (the compiler cannot know)
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] =
        same && folded != 0xFFFFFFFFu ? first + 1.0f : CUDART_NAN_F;

    handoff_done(handoff);
}
