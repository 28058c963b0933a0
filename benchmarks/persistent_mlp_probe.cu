// One persistent launch for the MLP half of a decode layer at batch 1 (o -> gate_up -> down),
// the probe of benchmarks/persistent_mlp_probe.py: is it faster than the engine's three
// PDL-chained GEMVs (docs/perf-notes.md, sessions 16 and 18)?
//
// Why: a GEMV CTA of 32 warps at 64 registers fills an SM's register file, so under PDL none of
// down's CTAs can be resident until gate_up's CTAs on that SM have left: down's weight stream
// starts from an empty pipe after gate_up's tail (~1.5-2.5 us a layer by session 16's
// leave-one-out). Here one CTA of 32 warps per SM runs all three phases, and a warp that has
// finished its part of a phase copies its first ring of the next phase's WEIGHTS at once
// (weights need no wait) and only then waits for the phase before to be done everywhere. So
// down's stream starts under gate_up's tail inside the same CTA, the shared memory passing from
// one phase to the next as each warp's own ring.
//
// Shapes (Llama-3.2-1B, m = 1, bf16; compile-time, the .py reads them): per layer
//   o:       q   += p   @ W_o^T    W_o  [HIDDEN, HIDDEN]            (residual add)
//   gate_up: act  = silu(gate) * up of q @ W_gu^T, W_gu = [gate; up] [2 * INTERMEDIATE, HIDDEN]
//   down:    p   += act @ W_d^T    W_d  [HIDDEN, INTERMEDIATE]      (residual add)
// p and q are two bf16 [HIDDEN] streams, so no phase reads the buffer it writes (o's input in the
// engine is the attention's output; here it is the previous layer's down output, which keeps the
// chain dependent from layer to layer). `layers` layers run in one launch, layer l's weights at
// w + l * (rows * k); one launch per layer is layers = 1 with the layer's pointers.
//
// Each phase is gemv.cu's GEMV cut into teams: a tile is 16 output rows (one m16n8k16 A tile),
// a team is the tile's k-split, K_WARPS warps (the engine's: o 16, gate_up 4, down 32), so a CTA
// holds WARPS / K_WARPS teams (2, 8, 1). Tile i goes to CTA i % gridDim.x, and the j-th tile of a
// CTA to its team j % teams (a later round when a CTA has more tiles than teams: GPUs with fewer
// than 128 SMs); on 132 SMs o and down use CTAs 0-127 (team 0), gate_up's 1,024 tiles 7-8 teams a
// CTA. Team 0 (warp 0) therefore has a tile in a phase whenever its CTA has any, and CTA 0 has a
// tile in every phase. Inside a team everything is gemv.cu's ring path at batch 1: warp w of the
// team walks steps [w*S/K_WARPS, (w+1)*S/K_WARPS) of the S = k/32 steps, in order, through its
// own ring of RING_STEPS cp.async slots (W copied before the wait, X after it), the same
// mma.sync fragment trick (A = {p.x, q.x, p.y, q.y}, B = {v.x, v.y}, then .z/.w), the team's
// partial tiles summed by its first warp in warp order from 0.f, and the same epilogue
// arithmetic (the fp32 residual add rounded once; silu_times on the bf16-rounded gate and up). So
// each output's summation order is gemv_bf16's / gemv_silu_mul_bf16's at the same k-split, and
// the outputs are bitwise those of the three GEMVs (the .py checks it). Batch 1 only: the X
// chunk is copied by the 4 lanes of x row 0 (g = 0), the other lanes feed zero B columns, which
// no output of row 0 reads (an mma's column j depends on B's column j only), and a warp's partial
// is its 16 row-0 sums (64 bytes). A team's partial tiles meet at a named barrier of its own
// (bar.sync id, 32 * K_WARPS threads; ids per phase and team, below) instead of __syncthreads.
//
// Hand-over between phases (stage s = 3 * layer + phase of this launch):
//   stage 0 waits with griddepcontrol.wait (the previous launch or graph wrote p): as the
//     engine's kernels do, so per-layer launches chain with PDL.
//   stage s > 0 waits until counters[s - 1] holds the tile count of stage s - 1. Each team's
//     first warp stores its 16 outputs, __syncwarp (orders its lanes' stores before lane 0's next
//     operations, CUDA's guarantee for the participants), and lane 0 bumps its stage's counter
//     with red.release.gpu: the release is cumulative, so the lanes' stores reach L2 before the
//     bump can be seen (the pattern of cooperative groups' grid sync: barrier, then one thread's
//     fence + atomic). The wait: warp 0 of the CTA (team 0's first warp; it has work in every
//     stage its CTA has any) polls the counter with ld.acquire.gpu (one poller per SM, 100 ns
//     sleeps: session 14's least contended variant), then publishes the stage in shared memory
//     with st.release.cta; the CTA's other warps of the stage spin on that word with
//     ld.acquire.cta. Causality is transitive through the chain release.gpu -> acquire.gpu ->
//     release.cta -> acquire.cta, and every read of another CTA's output goes through L2
//     (cp.async.cg, ld.cg), so no stale L1 line can be read. Only warps with a tile in a stage
//     wait for it; each thread also executes griddepcontrol.wait in its first wait, so every
//     thread is ordered after the previous grid whatever its first stage is.
//   The last stage of a launch bumps nothing (the next launch waits by griddepcontrol.wait).
//   Reset, so that every graph replay starts from zero: the counter of stage s - 2 is zeroed by
//   CTA 0's warp 0 once it has passed stage s's wait (all of stage s - 1 is done, so every
//   poller of that counter has seen it and left); the launch's stage 0 zeroes `reset_counter`,
//   the counter of two stages back in the previous launch (.py's counter_plan: the previous
//   layer's gate_up counter, or this launch's own last polled one in the one-launch chain, which
//   the next replay reaches only after this launch has completed). The store is st.relaxed.gpu,
//   so it is ordered with the other CTAs' atomics (a plain store would be a data race with them);
//   the next bump of that counter is causally after it (release/acquire chain from CTA 0).
//   A spin of ~2 s (a wrong plan) traps, so the launch fails instead of hanging the GPU.
// Deadlock: a stage's spin needs every CTA resident (the .py asserts one CTA per SM fits by an
// occupancy query and launches gridDim.x = SMs); a warp skips a phase it has no tile in, and the
// poller of a stage is the warp that also has a tile in the stage before, so it never waits on a
// warp of its own CTA that is behind it (a warp waits only on stages its own CTA can complete).
// Buffers the next stage overwrites are read by the stage before only: q (o's output) is read by
// gate_up; o of the next layer writes q only after down's counter, which needs all of gate_up.
// Partials are per phase and warp, so a team's reduction never sees another phase's tile; within
// a phase a team with a second tile (fewer than 128 SMs) meets at its barrier before rewriting.
//
// Resources (nvcc 13.0 -arch=sm_90 -std=c++17 -cubin -Xptxas -v): persistent_mlp 52 registers
// (53 before the timeline marks went in), 0 bytes stack frame, 0 bytes spill stores, 0 bytes
// spill loads, 16 barriers (the named barrier ids are run-time values, so ptxas reserves all
// 16), 16 bytes static shared memory (`ready`),
// + SHARED_BYTES = 145,408 dynamic (the SM has 233,472; 227 KB a CTA at most). The ring needs
// less than gemv.cu's (6,400 bytes a warp): x row 0 only, and no norm-weight chunks.
// __launch_bounds__(1024, 1) caps registers at 64 (1,024 threads x 64 = the SM's 65,536).
#include "common.cuh"

namespace {

constexpr int THREADS = 1024;   // one 32-warp CTA per SM
constexpr int WARPS = THREADS / 32;
constexpr int HIDDEN = 2048;
constexpr int INTERMEDIATE = 8192;
constexpr int TILE_ROWS = 16;   // outputs per tile: the M of one m16n8k16
constexpr int STEP_K = 32;      // k per warp step: 4 lanes x 8 bf16 per W row
// the engine's k-splits of Llama-1B's GEMVs on 132 SMs (gpu/ops.py's decode_k_warps)
constexpr int O_K_WARPS = 16;
constexpr int GATE_UP_K_WARPS = 4;
constexpr int DOWN_K_WARPS = 32;
constexpr int PHASES = 3;
constexpr int RING_STEPS = 4;   // gemv.cu's: the same bytes in flight per warp
// one ring slot: W rows g and g + 8 (16 bytes a lane each), then x row 0's 64 bytes (lanes g = 0)
constexpr int SLOT_QUADS = 2 * 32 + 4;
constexpr int RING_BYTES_PER_WARP = RING_STEPS * SLOT_QUADS * 16;
constexpr int PARTIAL_BYTES_PER_WARP = PHASES * TILE_ROWS * 4;   // row 0's 16 sums, per phase
constexpr int SHARED_BYTES = WARPS * (RING_BYTES_PER_WARP + PARTIAL_BYTES_PER_WARP);
constexpr int COUNTER_STRIDE = 32;   // words from one counter to the next: one 128-byte line each
constexpr int POLL_SLEEP_NS = 100;   // between two polls of a global counter
constexpr int WIDE_L2 = 1;           // W copies with the .L2::256B hint, as the engine's ring path
// 1: the poller (warp 0) copies its first ring of a phase's weights only after its wait has
// passed (the other warps still copy first). Why a switch: in the SASS (cuobjdump, session 20)
// the poller publishes the pass with st.release.cta = MEMBAR.ALL.CTA + STS, and that fence may
// hold the publish until the poller's own just-issued weight copies have landed, holding back
// the whole CTA; `--variant POLLER_WAITS_FIRST=1` measures it.
constexpr int POLLER_WAITS_FIRST = 0;
// named barrier ids (0 is __syncthreads): o's teams 1-2, gate_up's 3-10, down's 11
constexpr int O_BARRIER = 1;
constexpr int GATE_UP_BARRIER = O_BARRIER + WARPS / O_K_WARPS;
constexpr int DOWN_BARRIER = GATE_UP_BARRIER + WARPS / GATE_UP_K_WARPS;
constexpr long long SPIN_LIMIT_CYCLES = 4000000000LL;
// The optional timeline (session 20: the probe lost 13 us a layer and no launch constant said
// where): warp 0 of each CTA, which has a tile in every stage its CTA has any, writes per stage
//   0: clock64() as it starts the phase (before its first W copies),
//   1: clock64() when the stage's wait has passed,   3: %globaltimer (ns) at the same point,
//   2: clock64() after its team's epilogue and bump,  4: %globaltimer (ns) at the same point,
// at timeline[(cta * stages + stage) * TIMELINE_FIELDS + field]; stages its CTA has no tile in
// keep what the host put there. clock64 counts this SM's cycles (durations inside one CTA);
// %globaltimer is one clock for all SMs (the hand-over from the last bump to each CTA's pass).
constexpr int TIMELINE_FIELDS = 5;

static_assert(DOWN_BARRIER + WARPS / DOWN_K_WARPS <= 16, "16 named barriers per CTA");
static_assert(WARPS % O_K_WARPS == 0 && WARPS % GATE_UP_K_WARPS == 0 && WARPS % DOWN_K_WARPS == 0,
              "a CTA holds whole teams");
static_assert(HIDDEN % (STEP_K * DOWN_K_WARPS) == 0 && INTERMEDIATE % (STEP_K * DOWN_K_WARPS) == 0,
              "every warp walks whole steps, no bounds to test");
static_assert(SHARED_BYTES <= 227 * 1024, "an SM's opt-in shared memory");

enum class Phase { o, gate_up, down };

template <Phase P> struct Shape;
template <> struct Shape<Phase::o> {
    static constexpr int INDEX = 0, K_WARPS = O_K_WARPS, K = HIDDEN, ROWS = HIDDEN, BARRIER = O_BARRIER;
};
template <> struct Shape<Phase::gate_up> {
    static constexpr int INDEX = 1, K_WARPS = GATE_UP_K_WARPS, K = HIDDEN, ROWS = 2 * INTERMEDIATE,
                         BARRIER = GATE_UP_BARRIER;
};
template <> struct Shape<Phase::down> {
    static constexpr int INDEX = 2, K_WARPS = DOWN_K_WARPS, K = INTERMEDIATE, ROWS = HIDDEN, BARRIER = DOWN_BARRIER;
};

// bar.sync on a team's own barrier: `threads` (a multiple of 32) from this team only
__device__ __forceinline__ void team_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int load_acquire_cta(const int* p) {
    int v;
    asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_cta(int* p, int v) {
    asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(smem_addr(p)), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void spin_guard(long long start) {
    if (clock64() - start > SPIN_LIMIT_CYCLES) __trap();
}

// What a launch's stages share: the counters, and the stage its CTA has seen ready.
struct Chain {
    unsigned* counters;        // this launch's: stage s's at counters[s * COUNTER_STRIDE]
    unsigned* reset_counter;   // zeroed at stage 0 (the header), or null
    int stages;
    int* ready;                // shared: the highest stage this CTA's poller has seen ready
    unsigned long long* timeline;   // [ctas][stages][TIMELINE_FIELDS] (above), or null: none kept

    // thread 0 (warp 0's lane 0) notes clock64 in `field` and, with_global_time, %globaltimer in `field + 2`
    __device__ __forceinline__ void mark(int stage, int field, bool with_global_time) const {
        if (timeline == nullptr || threadIdx.x != 0) return;
        unsigned long long* row = timeline + ((size_t)blockIdx.x * stages + stage) * TIMELINE_FIELDS;
        row[field] = clock64();
        if (with_global_time) row[field + 2] = global_ns();
    }
};

// Wait until stage `stage`'s input is complete (header): lane 0 of the warp waits, the warp meets.
__device__ __forceinline__ void wait_stage(const Chain& chain, int stage, int warp, int lane, unsigned wait_count) {
    wait_for_producer();   // every thread; once satisfied it returns at once
    if (lane == 0 && stage > 0) {
        const long long start = clock64();
        if (warp == 0) {   // the CTA's poller
            const unsigned* counter = chain.counters + (size_t)(stage - 1) * COUNTER_STRIDE;
            while (load_acquire_gpu(counter) < wait_count) {
                __nanosleep(POLL_SLEEP_NS);
                spin_guard(start);
            }
            store_release_cta(chain.ready, stage);
        } else {
            while (load_acquire_cta(chain.ready) < stage) {
                __nanosleep(32);   // leave the issue slots to the warps still computing
                spin_guard(start);
            }
        }
    }
    // counters two stages back have no poller left (header); CTA 0's warp 0 has a tile everywhere
    if (blockIdx.x == 0 && warp == 0 && lane == 0) {
        unsigned* stale = stage >= 2 ? chain.counters + (size_t)(stage - 2) * COUNTER_STRIDE
                                     : stage == 0 ? chain.reset_counter : nullptr;
        if (stale != nullptr) asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(stale), "r"(0u) : "memory");
    }
    __syncwarp();
}

// One phase of one layer for this warp: every tile its team owns (header), x [K] -> y.
template <Phase P>
__device__ __forceinline__ void run_phase(const Chain& chain, int stage, uint4* ring, float* partials,
                                          const bf16* __restrict__ w, const bf16* x, bf16* y, unsigned wait_count) {
    using S = Shape<P>;
    constexpr int TEAMS = WARPS / S::K_WARPS, TILES = S::ROWS / TILE_ROWS, STEPS = S::K / STEP_K;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int team = warp / S::K_WARPS, member = warp % S::K_WARPS;   // member: the warp's place in its team
    const int g = lane >> 2, t = lane & 3;
    const int s_begin = member * STEPS / S::K_WARPS, my_steps = (member + 1) * STEPS / S::K_WARPS - s_begin;
    // this phase's partials: [WARPS][TILE_ROWS] (row 0 of x only)
    float* const part = partials + S::INDEX * WARPS * TILE_ROWS;
    bool first = true;
    for (int tile = blockIdx.x + gridDim.x * team; tile < TILES; tile += gridDim.x * TEAMS) {
        if (!first) team_barrier(S::BARRIER + team, 32 * S::K_WARPS);   // the last tile's partials are read
        // the tile's two runs of 8 W rows (gemv.cu's cta_tile): consecutive, or 8 gate rows and their 8 up rows
        const int row_a = P == Phase::gate_up ? tile * 8 : tile * TILE_ROWS;
        const int row_b = P == Phase::gate_up ? S::ROWS / 2 + tile * 8 : row_a + 8;
        const bf16* w0 = w + (size_t)(row_a + g) * S::K + s_begin * STEP_K + 8 * t;
        const bf16* w1 = w + (size_t)(row_b + g) * S::K + s_begin * STEP_K + 8 * t;
        const bf16* xr = x + s_begin * STEP_K + 8 * t;
        auto copy_w = [&](int i) {
            uint4* slot = ring + (i % RING_STEPS) * SLOT_QUADS;
            ring_copy(slot + lane, w0 + i * STEP_K, 16, WIDE_L2);   // common.cuh: past L1, the L2 hint as gemv.cu
            ring_copy(slot + 32 + lane, w1 + i * STEP_K, 16, WIDE_L2);
        };
        auto copy_x = [&](int i) {   // through L2: x is another CTA's output
            if (g == 0) cp_async16(smem_addr(ring + (i % RING_STEPS) * SLOT_QUADS + 64 + t), xr + i * STEP_K, 16);
        };
        auto copy_first_ring = [&]() {   // one group per step (the loop below counts groups)
#pragma unroll
            for (int i = 0; i < RING_STEPS; ++i) {
                if (i < my_steps) copy_w(i);
                cp_async_commit();
            }
        };
        // W first, issued before the wait (weights are written by no kernel); the poller after it
        // where POLLER_WAITS_FIRST says so (warp-uniform: warp 0 alone)
        const bool copy_after_wait = POLLER_WAITS_FIRST && first && warp == 0;
        if (first) chain.mark(stage, 0, false);
        if (!copy_after_wait) copy_first_ring();
        if (first) {
            wait_stage(chain, stage, warp, lane, wait_count);
            chain.mark(stage, 1, true);
        }
        if (copy_after_wait) copy_first_ring();
#pragma unroll
        for (int i = 0; i < RING_STEPS; ++i)
            if (i < my_steps) copy_x(i);
        cp_async_commit();
        cp_async_wait<0>();
        // gemv.cu's ring loop: at step i >= RING_STEPS exactly RING_STEPS - 1 groups came after its own
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < my_steps; ++i) {
            if (i >= RING_STEPS) cp_async_wait<RING_STEPS - 1>();
            const uint4* slot = ring + (i % RING_STEPS) * SLOT_QUADS;
            const uint4 p = slot[lane], q = slot[32 + lane];
            uint4 v = make_uint4(0u, 0u, 0u, 0u);   // x rows 1..7: zero B columns
            if (g == 0) v = slot[64 + t];            // each lane reads back only what it copied
            mma_bf16(acc, p.x, q.x, p.y, q.y, v.x, v.y);   // gemv.cu's mma_pair: its header has the layout
            mma_bf16(acc, p.z, q.z, p.w, q.w, v.z, v.w);
            if (i + RING_STEPS < my_steps) {         // the slot's reads are in registers: refill it
                copy_w(i + RING_STEPS);
                copy_x(i + RING_STEPS);
            }
            cp_async_commit();
        }
        // lane (g, 0) holds x row 0's sums of tile columns g (acc[0]) and 8 + g (acc[2])
        if (t == 0) {
            part[warp * TILE_ROWS + g] = acc[0];
            part[warp * TILE_ROWS + 8 + g] = acc[2];
        }
        team_barrier(S::BARRIER + team, 32 * S::K_WARPS);
        if (member == 0) {   // the team's first warp: gemv.cu's epilogue for row 0, lanes 0..15
            const bool live = lane < TILE_ROWS;
            float sum = 0.f;   // from 0.f, in team warp order: gemv.cu's sum, bit for bit
            if (live)
                for (int v = 0; v < S::K_WARPS; ++v) sum += part[(team * S::K_WARPS + v) * TILE_ROWS + lane];
            if constexpr (P == Phase::gate_up) {
                // gemv_silu_mul's: gate and up rounded to bf16 as the unfused chain reads them, the
                // partner (column c ^ 8) one shuffle away; every lane takes part in it
                const float value = bf16_round(sum);
                const float partner = __shfl_xor_sync(0xffffffffu, value, 8);
                if (lane < 8) y[row_a + lane] = __float2bfloat16(silu_times(value, partner));
            } else if (live) {   // gemv_bf16 with accumulate: the old value + the sum, rounded once
                const int out = row_a + lane;   // row_b = row_a + 8: the 16 columns are consecutive
                y[out] = __float2bfloat16(__bfloat162float(__ldcg(y + out)) + sum);
            }
            __syncwarp();   // the lanes' stores before lane 0's release (header)
            if (lane == 0 && stage + 1 < chain.stages)
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;"
                             ::"l"(chain.counters + (size_t)stage * COUNTER_STRIDE) : "memory");
            if (first) chain.mark(stage, 2, true);
        }
        first = false;
    }
}

}  // namespace

// `layers` layers of o -> gate_up -> down (header). p, q: bf16 [HIDDEN] (o reads p and adds into
// q, down adds into p); act: bf16 [INTERMEDIATE]; w_o [layers][HIDDEN][HIDDEN], w_gu [layers][2 *
// INTERMEDIATE][HIDDEN] (gate rows first), w_d [layers][HIDDEN][INTERMEDIATE]; counters: 3 *
// layers of them, COUNTER_STRIDE words apart, zero before the first launch; reset_counter: the
// counter this launch zeroes after its griddepcontrol.wait (null: none); timeline: null, or
// [gridDim.x][3 * layers][TIMELINE_FIELDS] u64 for warp 0's marks (above). Launch: gridDim.x = the
// SM count (every CTA resident), THREADS threads, SHARED_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
persistent_mlp(bf16* p, bf16* q, bf16* act, const bf16* __restrict__ w_o, const bf16* __restrict__ w_gu,
               const bf16* __restrict__ w_d, int layers, unsigned* counters, unsigned* reset_counter,
               unsigned long long* timeline) {
    extern __shared__ uint4 smem[];   // [WARPS] rings, then [PHASES][WARPS][TILE_ROWS] fp32 partials
    __shared__ int ready;
    allow_consumer();
    if (threadIdx.x == 0) ready = -1;
    __syncthreads();   // the only CTA-wide barrier: before any warp can wait on `ready`
    const int warp = threadIdx.x >> 5;
    uint4* const ring = smem + warp * (RING_BYTES_PER_WARP / 16);
    float* const partials = reinterpret_cast<float*>(smem + WARPS * (RING_BYTES_PER_WARP / 16));
    const Chain chain{counters, reset_counter, 3 * layers, &ready, timeline};
    constexpr unsigned O_TILES = HIDDEN / TILE_ROWS, GATE_UP_TILES = 2 * INTERMEDIATE / TILE_ROWS;
    constexpr unsigned DOWN_TILES = HIDDEN / TILE_ROWS;
    for (int layer = 0; layer < layers; ++layer) {
        const int s = 3 * layer;
        run_phase<Phase::o>(chain, s, ring, partials, w_o + (size_t)layer * HIDDEN * HIDDEN, p, q, DOWN_TILES);
        run_phase<Phase::gate_up>(chain, s + 1, ring, partials, w_gu + (size_t)layer * 2 * INTERMEDIATE * HIDDEN,
                                  q, act, O_TILES);
        run_phase<Phase::down>(chain, s + 2, ring, partials, w_d + (size_t)layer * HIDDEN * INTERMEDIATE, act, p,
                               GATE_UP_TILES);
    }
}
