// What a kernel boundary costs inside a decode graph, and what a counter in global memory costs
// instead: the stub kernel of benchmarks/handoff_bench.py (the engine hands over by
// griddepcontrol.wait alone; docs/perf-notes.md, session 14, has the measurement).
//
// A chain of stages, each a grid that needs ALL of the previous stage's output, the way every
// kernel of the decode layer does (a GEMV reads the whole x row, the attention the whole q/k/v of
// its kv head). Each block reads the `width` floats of `in`, streams `weight_quads` 16-byte
// quads of weights of its own (0: none), and writes its slice of `out`. Blocks from busy_blocks
// on leave at once (and count themselves done), like the decode attention's splits that a short
// context does not use. The handoff is one of:
//   griddepcontrol.wait (wait_counter = null): the engine's. Under programmatic dependent launch
//     the stage is resident early (allow_consumer first thing) and waits for the whole previous
//     grid to complete and flush (common.cuh).
//   a counter (wait_counter != null): each block of the producer, its stores done, syncs and
//     bumps the producer's counter with a release reduction (cumulative over the block's stores,
//     which the barrier ordered before it); the consumer polls it with acquire loads until it
//     holds the producer's block count (at gpu scope an acquire also drops the SM's stale L1
//     lines), then syncs. Block 0 of each stage zeroes the counter two stages back, which
//     nobody reads again in this pass (handoff_bench.py's counter_plan), so a graph replays
//     with fresh counters.
// A poll that spins for ~2 s (a chain planned wrong) traps, so the launch fails instead of hanging
// the GPU.
#include <math_constants.h>
#include "common.cuh"

namespace {

constexpr int UNROLL = 4;   // weight quads in flight per thread
// How the consumer polls (handoff_bench.py --variant rewrites these): POLL_PER_BLOCK 1: thread 0
// of the block polls and the block syncs; 0: lane 0 of every warp polls and the warp syncs (what
// a kernel whose warps reach their wait at different points, like the GEMV, would need).
// POLL_RELAXED 1: relaxed loads and one acquire fence once the count is reached. POLL_SLEEP_NS
// > 0: __nanosleep between tries, so the pollers of every stage resident ahead of its turn crowd
// the counter's L2 slice less. The defaults are the best of session 14's measurements.
constexpr int POLL_PER_BLOCK = 1;
constexpr int POLL_RELAXED = 0;
constexpr int POLL_SLEEP_NS = 100;
constexpr long long SPIN_LIMIT_CYCLES = 4000000000LL;

__device__ __forceinline__ uint4 load_weight(const uint4* p) {   // read once, past L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// This block's weight quads [begin, quads) of w (begin and the loop are per block; each thread
// takes every blockDim.x-th), UNROLL loads in flight per thread, folded into `folded`.
__device__ __forceinline__ void stream_weights(const uint4* w, int begin, int quads, unsigned& folded) {
    for (int i0 = begin + threadIdx.x; i0 < quads; i0 += UNROLL * blockDim.x) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < quads ? load_weight(w + i) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
}

__device__ __forceinline__ void handoff_wait(const unsigned* wait_counter, unsigned wait_count) {
    if (wait_counter == nullptr) {
        wait_for_producer();
        return;
    }
    if ((POLL_PER_BLOCK ? threadIdx.x : threadIdx.x & 31) == 0) {
        const long long start = clock64();
        unsigned seen;
        while (true) {
            if (POLL_RELAXED)
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(wait_counter) : "memory");
            else
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(wait_counter) : "memory");
            if (seen >= wait_count) break;
            if (POLL_SLEEP_NS > 0) __nanosleep(POLL_SLEEP_NS);
            if (clock64() - start > SPIN_LIMIT_CYCLES) __trap();
        }
        if (POLL_RELAXED) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    if (POLL_PER_BLOCK)
        __syncthreads();
    else
        __syncwarp();
}

__device__ __forceinline__ void handoff_done(unsigned* done_counter) {   // every thread, after its stores
    if (done_counter == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(done_counter) : "memory");
}

}  // namespace

extern "C" __global__ void handoff_stage(float* out, const float* in, int width, const uint4* weights,
                                         int weight_quads, const unsigned* wait_counter, unsigned wait_count,
                                         unsigned* done_counter, unsigned* reset_counter, int busy_blocks) {
    allow_consumer();
    if ((int)blockIdx.x >= busy_blocks) {   // as the decode attention's unused splits do
        handoff_done(done_counter);
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

    handoff_wait(wait_counter, wait_count);
    // a counter nobody polls any more (header); before this block's release below
    if (reset_counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *reset_counter = 0u;

    // All of the previous stage's output, through L2 (other SMs wrote it): every value must equal
    // in[0], and this thread's output is in[0] + 1 (NaN if not), so a block that read too early
    // (a stale value of the replay before) poisons the end of the chain (handoff_bench.py checks).
    const float first = __ldcg(in);
    bool same = true;
    for (int i = threadIdx.x; i < width; i += blockDim.x) same &= __ldcg(in + i) == first;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) folded ^= early[u].x ^ early[u].y ^ early[u].z ^ early[u].w;
    stream_weights(w, UNROLL * blockDim.x, weight_quads, folded);
    // the weights are zeros: `folded` only keeps their loads alive (the compiler cannot know)
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] =
        same && folded != 0xFFFFFFFFu ? first + 1.0f : CUDART_NAN_F;

    handoff_done(done_counter);
}

// The same chain inside one thread-block cluster: a single launch of one cluster (gridDim.x CTAs,
// 8 portable or 16 with the non-portable size allowed) runs `stages` stages, each reading all
// `width` floats the cluster wrote in the stage before (ping-pong buffers a and b), streaming
// `weight_quads` quads of weights per CTA, writing its share of the output, and ending with a
// cluster barrier (release/acquire at cluster scope) instead of a kernel boundary. It prices the
// sync a cluster-persistent decode step would pay per stage, and the bandwidth a cluster's few SMs
// can pull: the question for a small model whose step is all boundaries.
extern "C" __global__ void cluster_chain(float* buf_a, float* buf_b, int width, int stages, const uint4* weights,
                                         int weight_quads, unsigned long long pool_quads) {
    const int ctas = gridDim.x, rank = blockIdx.x;
    const int share = (width + ctas - 1) / ctas;
    unsigned folded = 0;
    for (int s = 0; s < stages; ++s) {
        const float* in = (s & 1) ? buf_b : buf_a;
        float* out = (s & 1) ? buf_a : buf_b;
        const uint4* w = weights + ((unsigned long long)s * weight_quads * ctas + (unsigned long long)rank * weight_quads)
                                       % (pool_quads - weight_quads);
        stream_weights(w, 0, weight_quads, folded);
        const float first = __ldcg(in);
        bool same = true;
        for (int i = threadIdx.x; i < width; i += blockDim.x) same &= __ldcg(in + i) == first;
        // a block's verdict: every thread's, so one early read anywhere poisons the chain
        same = __syncthreads_and(same);
        for (int i = rank * share + threadIdx.x; i < min(width, (rank + 1) * share); i += blockDim.x)
            out[i] = same && folded != 0xFFFFFFFFu ? first + 1.0f : CUDART_NAN_F;
        asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    }
}
