// Sampling: one thread block per sequence turns a row of fp32 logits into one token id.
// The algorithm is defined in tinyvllm/reference/sampling.py (module docstring); this file is its CUDA
// twin, written op for op so that both pick the same token. Two optional kernels surround it, each
// launched only for a step that needs it (so a plain step runs sample_tokens alone, as before):
//   apply_logit_edits   before: min_tokens, logit_bias and the penalties as sparse in-place edits
//                       of listed (row, token) logits (engine/batch.py's LogitEdits), one thread each
//   step_logprobs       after, on a copy of the raw logits: log-softmax of the sampled token, its
//                       rank, and the top-k ids and log-probs of each row that asked
//
// Launch: grid = (num_seqs, slices), block = (SAMPLE_THREADS = 1024), no dynamic shared memory.
// Passes over the row (vocab = 128256 -> 126 elements per thread):
//   1. argmax / max (or, head_argmax non-null, read from the keys the decode LM head kept as it
//      stored the logits: common.cuh's argmax_key, the same max, index and broken flag in one word);
//      a row with NaN or +inf, or with no finite value, gets id -1 (NON_FINITE in
//      sampling.py) and stops: the engine fails that request alone (greedy rows stop here too).
//      With slices > 1 this pass is split: block (row, y) takes the y-th slice of the row and
//      stores its max, lowest index and NaN/+inf flag in partials[row][y]; the block that
//      arrives last (slice_counters[row], reset to 0 by it) combines the slices in index order
//      with the same tie rule, so the max and argmax are exactly the one-block pass's, and alone
//      goes on with passes 2-5. Why: at batch 1 a greedy step's whole sampler is this pass, and
//      one block reads a 128,256-entry row at one SM's bandwidth (~16 us in the decode graph on
//      Llama-1B); 32 blocks read it at once. The launcher picks slices (GpuOps.sample_slices).
//   2. e_i = exp((x_i - m) / T), written IN PLACE over the logits row; Z = sum of masses
//   3. top-k: radix select of the k-th largest e           (4 passes, 8 bits each)
//   4. top-p: radix select of the mass threshold           (4 passes, 8 bits each)
//   5. inverse-CDF draw: per-thread contiguous chunks, block prefix scan of the chunk masses,
//      the one thread whose chunk holds the draw walks it.
// No sort, no atomics on floats: all sums are of uint64 masses, so the result does not depend
// on the order of additions and the kernel is deterministic.
#include "common.cuh"

constexpr int SAMPLE_THREADS = 1024;
constexpr int NUM_WARPS = SAMPLE_THREADS / 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr float MASS_SCALE = 1099511627776.0f;   // 2^40
constexpr int EDIT_THREADS = 256;                  // apply_logit_edits: one thread per entry
constexpr int EDIT_WORDS = 8;                      // 4-byte words per LogitEdit (engine/batch.py)
constexpr int MAX_TOP_LOGPROBS = 20;               // step_logprobs' largest k
constexpr int MAX_ARGMAX_SLICES = 32;              // blocks per row in pass 1: one warp combines them
#define ARGMAX_SLICE_VALUES 4096   // host only: the launcher's slice size, 4 logits per thread

typedef unsigned long long u64;

// ---- counter-based random bits: splitmix64 (same constants as sampling.py) ----------------
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 random_bits24(u64 seed, int step) {
    return mix64(mix64(seed) + (u64)(step + 1) * 0x9E3779B97F4A7C15ull) >> 40;
}

// ---- e^z for z <= 0, every op rounded on its own (no FMA contraction, as in numpy) --------
__device__ __forceinline__ float weight_exp(float x, float m, float inv_t) {
    float t = __fmul_rn(__fmul_rn(__fsub_rn(x, m), inv_t), __int_as_float(0x3FB8AA3B)); // log2 e
    if (!(t >= -125.0f)) return 0.0f;                     // no mass anyway; also catches NaN
    float n = rintf(t);
    float f = __fsub_rn(t, n);
    float p = __int_as_float(0x39218489);                 // (ln 2)^6 / 6!
    p = __fadd_rn(__fmul_rn(p, f), __int_as_float(0x3AAEC3FF));
    p = __fadd_rn(__fmul_rn(p, f), __int_as_float(0x3C1D955B));
    p = __fadd_rn(__fmul_rn(p, f), __int_as_float(0x3D635847));
    p = __fadd_rn(__fmul_rn(p, f), __int_as_float(0x3E75FDF0));
    p = __fadd_rn(__fmul_rn(p, f), __int_as_float(0x3F317218));
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));   // * 2^n, exact
}

__device__ __forceinline__ u64 mass_of(float e) { return __float2ull_rn(__fmul_rn(e, MASS_SCALE)); }

// ordered_key (a float's bits in float order) lives in common.cuh, beside the LM head's argmax keys.

// ---- block-wide helpers (all threads of the block must call them) --------------------------
struct Scratch {
    u64 warp_u64[NUM_WARPS];
    float warp_val[NUM_WARPS];
    int warp_idx[NUM_WARPS];
    u64 hist[256];
    u64 chosen_above;
    unsigned chosen_digit;
    int row_broken;       // sliced_argmax's combined flag
};

__device__ __forceinline__ u64 block_sum(u64 v, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();                                       // scratch may still be read
    if (lane == 0) s.warp_u64[warp] = v;
    __syncthreads();
    u64 total = 0;
    for (int w = 0; w < NUM_WARPS; ++w) total += s.warp_u64[w];
    return total;
}

// Exclusive prefix sum over threads in thread order; *total gets the block's sum.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* total, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        u64 up = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) s.warp_u64[warp] = incl;
    __syncthreads();
    u64 before = 0, sum = 0;
    for (int w = 0; w < NUM_WARPS; ++w) {
        if (w < warp) before += s.warp_u64[w];
        sum += s.warp_u64[w];
    }
    *total = sum;
    return before + incl - v;
}

constexpr int NO_INDEX = 0x7fffffff;   // the argmax index of an empty or all -inf range

// The argmax rule: the larger value, the lower index among equal values.
__device__ __forceinline__ void keep_better(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
}

// Max of x[begin, end) and its lowest index (NO_INDEX if nothing beats -inf). Returns true (in
// every thread) when the range holds a NaN or +inf (comparisons skip NaN, so it is tested apart).
__device__ __forceinline__ bool block_argmax_range(const float* x, int begin, int end, float* best_val,
                                                   int* best_idx, Scratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float bv = -INFINITY;
    int bi = NO_INDEX;
    int broken = 0;
    for (int i = begin + threadIdx.x; i < end; i += SAMPLE_THREADS) {
        float v = x[i];
        broken |= !(v < INFINITY);                        // NaN or +inf
        keep_better(bv, bi, v, i);
    }
    broken = __syncthreads_or(broken);
    for (int o = 16; o > 0; o >>= 1)
        keep_better(bv, bi, __shfl_xor_sync(FULL_MASK, bv, o), __shfl_xor_sync(FULL_MASK, bi, o));
    __syncthreads();
    if (lane == 0) { s.warp_val[warp] = bv; s.warp_idx[warp] = bi; }
    __syncthreads();
    bv = s.warp_val[0]; bi = s.warp_idx[0];
    for (int w = 1; w < NUM_WARPS; ++w) keep_better(bv, bi, s.warp_val[w], s.warp_idx[w]);
    *best_val = bv;
    *best_idx = bi;
    return broken;
}

// The end of pass 1 for a whole row, however its max was found (one block or combined slices):
// index 0 when nothing beat -inf; returns true when the row is broken: it held a NaN or +inf
// (saw_nan_or_inf), or nothing finite.
__device__ __forceinline__ bool finish_row_argmax(float best_val, int& best_idx, bool saw_nan_or_inf) {
    if (best_idx == NO_INDEX) best_idx = 0;
    return saw_nan_or_inf || best_val == -INFINITY;
}

// Max of the row and its lowest index. Returns true (in every thread) when the row is broken.
__device__ __forceinline__ bool block_argmax(const float* x, int vocab, float* best_val, int* best_idx, Scratch& s) {
    const bool saw = block_argmax_range(x, 0, vocab, best_val, best_idx, s);
    return finish_row_argmax(*best_val, *best_idx, saw);
}

// Pass 1 of one row split over gridDim.y blocks (header). Every block stores its slice's
// result; the last to arrive combines them and returns true (with the row's max, argmax and
// broken flag, as block_argmax gives them); the others return false and leave.
struct ArgmaxPartial {
    float val;
    int idx, broken, unused;
};

__device__ __forceinline__ bool sliced_argmax(const float* x, int vocab, ArgmaxPartial* partials,
                                              unsigned* counter, float* best_val, int* best_idx,
                                              bool* broken, Scratch& s) {
    const int slices = gridDim.y, per = (vocab + slices - 1) / slices;
    const int begin = min((int)blockIdx.y * per, vocab), end = min(begin + per, vocab);
    float bv;
    int bi;
    const bool seen = block_argmax_range(x, begin, end, &bv, &bi, s);
    bool last = false;
    if (threadIdx.x == 0) {
        partials[blockIdx.y] = ArgmaxPartial{bv, bi, seen, 0};
        __threadfence();                                   // the partial before the count
        last = atomicAdd(counter, 1u) == (unsigned)slices - 1;
    }
    if (!__syncthreads_or(last)) return false;
    __threadfence();                                       // every slice's partial is visible now
    if (threadIdx.x < 32) {                                // slices <= 32: one warp combines
        const int lane = threadIdx.x;
        ArgmaxPartial p{-INFINITY, NO_INDEX, 0, 0};
        if (lane < slices) {
            p.val = __ldcg(&partials[lane].val);           // from L2: written by other blocks
            p.idx = __ldcg(&partials[lane].idx);
            p.broken = __ldcg(&partials[lane].broken);
        }
        for (int o = 16; o > 0; o >>= 1)
            keep_better(p.val, p.idx, __shfl_xor_sync(FULL_MASK, p.val, o), __shfl_xor_sync(FULL_MASK, p.idx, o));
        p.broken = __any_sync(FULL_MASK, p.broken);
        if (lane == 0) {
            *counter = 0;                                  // ready for the next launch (graph replays)
            s.row_broken = finish_row_argmax(p.val, p.idx, p.broken);
            s.warp_val[0] = p.val;
            s.warp_idx[0] = p.idx;
        }
    }
    __syncthreads();
    *best_val = s.warp_val[0];
    *best_idx = s.warp_idx[0];
    *broken = s.row_broken != 0;
    __syncthreads();                                       // scratch is reused by the next pass
    return true;
}

// Largest key t (the bits of a non-negative float e, so integer order = float order; with
// ORDERED, ordered_key of any float) such that sum(weight_i for key_i >= t) >= target, where
// weight_i = mass_of(e_i) or 1 (counting: the target-th largest key). Requires 0 < target <=
// total weight. Four 8-bit digit passes; each builds a 256-bin histogram of the tokens whose
// higher digits match the prefix found so far.
template <bool ORDERED>
__device__ unsigned radix_select(const float* e, int vocab, bool weigh_by_mass, u64 target, Scratch& s) {
    const int lane = threadIdx.x & 31;
    unsigned prefix = 0;
    u64 above = 0;                                        // weight of keys above the prefix range
    for (int shift = 24; shift >= 0; shift -= 8) {
        const unsigned high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        __syncthreads();
        if (threadIdx.x < 256) s.hist[threadIdx.x] = 0;
        __syncthreads();
        for (int base = 0; base < vocab; base += SAMPLE_THREADS) {   // same trip count for all
            const int i = base + threadIdx.x;
            bool match = false;
            unsigned digit = 256;
            u64 w = 0;
            if (i < vocab) {
                const float v = e[i];
                const unsigned key = ORDERED ? ordered_key(v) : __float_as_uint(v);
                match = (key & high_mask) == prefix;
                digit = match ? (key >> shift) & 255u : 256u;
                w = weigh_by_mass ? mass_of(v) : 1ull;
            }
            const unsigned active = __ballot_sync(FULL_MASK, match);
            if (active == 0) continue;
            // Warp-aggregate: lanes with the same digit add their weights, their lowest lane
            // does one shared atomic (a plain per-lane atomic serialises on the few hot bins).
            const unsigned peers = __match_any_sync(FULL_MASK, digit);
            u64 sum = 0;
            for (unsigned m = active; m; m &= m - 1) {
                const int src = __ffs(m) - 1;
                const u64 v = __shfl_sync(FULL_MASK, w, src);
                if ((peers >> src) & 1u) sum += v;
            }
            if (match && lane == __ffs(peers) - 1) atomicAdd(&s.hist[digit], sum);
        }
        __syncthreads();
        if (threadIdx.x < 32) {   // warp 0: lane l holds digits 255-8l .. 248-8l (descending)
            u64 local = 0;
            for (int j = 0; j < 8; ++j) local += s.hist[255 - 8 * lane - j];
            u64 incl = local;
            for (int o = 1; o < 32; o <<= 1) {
                u64 up = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += up;
            }
            u64 acc = above + incl - local;
            if (acc < target && target <= acc + local) {
                for (int j = 0; j < 8; ++j) {
                    const unsigned d = 255 - 8 * lane - j;
                    if (acc + s.hist[d] >= target) { s.chosen_digit = d; s.chosen_above = acc; break; }
                    acc += s.hist[d];
                }
            }
        }
        __syncthreads();
        prefix |= s.chosen_digit << shift;
        above = s.chosen_above;
    }
    return prefix;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_tokens(float* __restrict__ logits,            // [num_seqs, vocab]; overwritten with e
              int vocab,
              const float* __restrict__ temperature,  // [num_seqs]; <= 0: greedy
              const int* __restrict__ top_k,          // [num_seqs]; <= 0 or >= vocab: off
              const float* __restrict__ top_p,        // [num_seqs]; >= 1: off
              const float* __restrict__ min_p,        // [num_seqs]; <= 0: off; null: all off
              const u64* __restrict__ seed,           // [num_seqs]
              const int* __restrict__ step,           // [num_seqs]; tokens generated so far
              int* __restrict__ out,                  // [num_seqs] sampled token ids
              ArgmaxPartial* __restrict__ partials,   // [num_seqs, MAX_ARGMAX_SLICES]; null: gridDim.y = 1
              unsigned* __restrict__ slice_counters,  // [num_seqs], 0 between launches; null: gridDim.y = 1
              const unsigned long long* head_argmax,  // [num_seqs] the LM head's argmax keys; null: pass 1 here
              int* out_host)                          // [num_seqs] mapped page-locked host memory, a copy of
                                                      // out for the host (a posted PCIe write); null: none
{
    allow_consumer();
    wait_for_producer();   // the logits are the LM head's output
    __shared__ Scratch s;
    const int row = blockIdx.x;
    float* x = logits + (size_t)row * vocab;

    float m;
    int argmax;
    bool broken;
    if (head_argmax) {                                    // pass 1 done by the LM head (gridDim.y = 1)
        broken = decode_argmax_key(__ldcg(head_argmax + row), m, argmax);
    } else if (gridDim.y == 1) {
        broken = block_argmax(x, vocab, &m, &argmax, s);
    } else if (!sliced_argmax(x, vocab, partials + (size_t)row * MAX_ARGMAX_SLICES, slice_counters + row,
                              &m, &argmax, &broken, s)) {
        return;                                           // not the row's last block
    }
    auto store = [&](int id) {                            // the row's id, and its host copy
        out[row] = id;
        if (out_host) out_host[row] = id;
    };
    const float temp = temperature[row];
    if (broken || !(temp > 0.0f)) {                       // uniform across the block
        if (threadIdx.x == 0) store(broken ? -1 : argmax);
        return;
    }

    const float inv_t = __frcp_rn(temp);
    // min_p: e = p_i / p_max exactly, so "p_i < min_p * p_max" is e < min_p; the mass top-p
    // divides is that of the survivors (min_p comes first, as in vLLM). min_p = 0 keeps all.
    const float pmin = min_p != nullptr ? fminf(fmaxf(min_p[row], 0.0f), 1.0f) : 0.0f;   // as SamplingBatch clamps
    u64 local = 0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float e = weight_exp(x[i], m, inv_t);
        x[i] = e;                                         // later passes read e, not logits
        if (e >= pmin) local += mass_of(e);
    }
    const u64 z = block_sum(local, s);                    // its barrier publishes the writes

    float tau = pmin;
    const int k = top_k[row];
    if (k > 0 && k < vocab) tau = fmaxf(tau, __uint_as_float(radix_select<false>(x, vocab, false, (u64)k, s)));
    const float p = top_p[row];
    if (p < 1.0f) {
        // target <= z: the threshold found is >= the smallest survivor's e, so >= pmin
        const u64 target = (u64)ceil((double)p * __ull2double_rn(z));
        tau = fmaxf(tau, __uint_as_float(radix_select<false>(x, vocab, true, target, s)));
    }

    // Inverse CDF in index order: thread t owns the contiguous chunk [t*chunk, (t+1)*chunk).
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int begin = min(threadIdx.x * chunk, vocab), end = min(begin + chunk, vocab);
    local = 0;
    for (int i = begin; i < end; ++i) {
        const float e = x[i];
        if (e >= tau) local += mass_of(e);
    }
    u64 kept_total;
    const u64 before = block_exclusive_scan(local, &kept_total, s);
    const u64 u = random_bits24(seed[row], step[row]);
    const u64 r = (kept_total >> 24) * u + (((kept_total & 0xFFFFFFull) * u) >> 24);   // < total
    if (before <= r && r < before + local) {
        u64 acc = before;
        for (int i = begin; i < end; ++i) {
            const float e = x[i];
            if (e >= tau) acc += mass_of(e);
            if (acc > r) { store(i); break; }
        }
    }
}


// ---- logit processing: sparse in-place edits ----------------------------------------------
// One entry per (row, token), unique: no two threads touch one logit. The five operations are
// LogitEdits' (engine/batch.py), each rounded on its own like numpy's fp32 ops. A NaN or +inf
// logit is left as it is, so that the sampler still sees the row as broken.
struct LogitEdit {
    int row, token, forbid;
    float bias, rep, freq, pres;
    int unused;
};
static_assert(sizeof(LogitEdit) == EDIT_WORDS * 4, "LogitEdit must match engine/logit_edits.py's packing");

extern "C" __global__ void __launch_bounds__(EDIT_THREADS)
apply_logit_edits(float* __restrict__ logits,           // [rows, vocab], edited in place
                  int vocab,
                  const LogitEdit* __restrict__ edits,  // [num_edits]
                  int num_edits)
{
    allow_consumer();
    wait_for_producer();   // the logits are the LM head's output
    const int i = blockIdx.x * EDIT_THREADS + threadIdx.x;
    if (i >= num_edits) return;
    const LogitEdit e = edits[i];
    if (e.token < 0 || e.token >= vocab) return;
    float* at = logits + (size_t)e.row * vocab + e.token;
    const float x = *at;
    if (!(x < INFINITY)) return;
    float y = e.forbid ? -INFINITY : x;
    y = __fadd_rn(y, e.bias);
    y = y > 0.0f ? __fdiv_rn(y, e.rep) : __fmul_rn(y, e.rep);
    y = __fsub_rn(y, e.freq);
    y = __fsub_rn(y, e.pres);
    *at = y;
}

// ---- raw logprobs ---------------------------------------------------------------------------
// One block per output row j, reading logits row r = rows[j] (rows null: r = j), sampled[r]:
//   lse = fp32(m + log(sum exp(x - m))), the sum in double (per-thread partials, then warps)
//   sampled_logprob[j] = x_s - lse, sampled_rank[j] = #{i : x_i >= x_s} (NaN / 0 when the id
//   is outside the vocabulary, as a broken row's -1 is)
//   top k: radix select of the k-th largest ordered key t; keys > t are all in, keys == t fill
//   the rest lowest index first (a chunked scan), then thread 0 sorts the k (key desc, index asc).
// reference/sampling.py's step_logprobs is the twin.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
step_logprobs(const float* __restrict__ logits,     // [*, vocab] raw logits
              int vocab,
              const int* __restrict__ rows,         // [num_rows] logits row of each output; null: j
              const int* __restrict__ sampled,      // indexed by logits row
              int k,                                // 0..MAX_TOP_LOGPROBS, <= vocab
              float* __restrict__ sampled_logprob,  // [num_rows]
              int* __restrict__ sampled_rank,       // [num_rows]
              int* __restrict__ top_ids,            // [num_rows, k]
              float* __restrict__ top_logprobs)     // [num_rows, k]
{
    allow_consumer();
    wait_for_producer();   // the sampled ids are the sampler's output
    __shared__ Scratch s;
    __shared__ double warp_sum[NUM_WARPS];
    __shared__ unsigned cand_key[MAX_TOP_LOGPROBS];
    __shared__ int cand_idx[MAX_TOP_LOGPROBS];
    __shared__ int num_above;
    const int j = blockIdx.x;
    const int r = rows != nullptr ? rows[j] : j;
    const float* x = logits + (size_t)r * vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    float m;
    int argmax;
    block_argmax(x, vocab, &m, &argmax, s);
    double part = 0.0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) part += exp((double)x[i] - (double)m);
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(FULL_MASK, part, o);
    if (lane == 0) warp_sum[warp] = part;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < NUM_WARPS; ++w) total += warp_sum[w];
    const float lse = __double2float_rn((double)m + log(total));

    const int sid = sampled[r];
    const bool valid = sid >= 0 && sid < vocab;
    const float xs = valid ? x[sid] : 0.0f;
    u64 local = 0;
    if (valid)
        for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) local += x[i] >= xs;
    const u64 rank = block_sum(local, s);
    if (threadIdx.x == 0) {
        sampled_logprob[j] = valid ? __fsub_rn(xs, lse) : __int_as_float(0x7fc00000);
        sampled_rank[j] = valid ? (int)rank : 0;
        num_above = 0;
    }
    if (k <= 0) return;

    const unsigned t = radix_select<true>(x, vocab, false, (u64)k, s);   // ends with a barrier
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const unsigned key = ordered_key(x[i]);
        if (key > t) {                                   // fewer than k of these
            const int slot = atomicAdd(&num_above, 1);
            cand_key[slot] = key;
            cand_idx[slot] = i;
        }
    }
    __syncthreads();
    const int need = k - num_above;                      // >= 1 ties at t, lowest index first
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int begin = min(threadIdx.x * chunk, vocab), end = min(begin + chunk, vocab);
    u64 ties = 0;
    for (int i = begin; i < end; ++i) ties += ordered_key(x[i]) == t;
    u64 all_ties;
    u64 before = block_exclusive_scan(ties, &all_ties, s);
    for (int i = begin; i < end && before < (u64)need; ++i) {
        if (ordered_key(x[i]) == t) {
            cand_key[num_above + before] = t;
            cand_idx[num_above + before] = i;
            ++before;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int a = 1; a < k; ++a) {                    // insertion sort: key desc, index asc
            const unsigned key = cand_key[a];
            const int idx = cand_idx[a];
            int b = a - 1;
            while (b >= 0 && (cand_key[b] < key || (cand_key[b] == key && cand_idx[b] > idx))) {
                cand_key[b + 1] = cand_key[b];
                cand_idx[b + 1] = cand_idx[b];
                --b;
            }
            cand_key[b + 1] = key;
            cand_idx[b + 1] = idx;
        }
    }
    __syncthreads();
    if (threadIdx.x < k) {
        const int idx = cand_idx[threadIdx.x];
        top_ids[(size_t)j * k + threadIdx.x] = idx;
        top_logprobs[(size_t)j * k + threadIdx.x] = __fsub_rn(x[idx], lse);
    }
}
