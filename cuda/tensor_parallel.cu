// The kernels a layer split over several tensor-parallel ranks adds to the single-GPU ones
// (gpu/tp_layer.py launches them; the single-GPU kernels are unchanged). On one GPU the residual
// add lives in the o / down GEMV's epilogue and the next RMSNorm is handed over from there
// (gemv.cu's header); over N ranks each rank's product is a partial sum, so every rank stores its
// bare product, NCCL sums the products in place, and these kernels do the rest after the sum.
//
//   embedding_gather_shard   out[t] = scale * table[id_t - vocab_start] for the ids of this rank's
//                            vocabulary slice [vocab_start, vocab_start + rows), a zero row for any
//                            other id (another rank holds it: the all-reduce after it adds exactly
//                            one non-zero row per token). scale: Gemma 3's bf16(sqrt(hidden)), 1
//                            elsewhere (a bf16 value times 1 rounds to itself: the plain gather's
//                            bits). id_t and fed ids as embedding.cu's embedding_gather; head_argmax
//                            (non-null) cleared to 0 as there. No norm is handed over here: the
//                            rows are partial until the all-reduce.
//   residual_add             hidden[r] = bf16(hidden[r] + x[r]) (x: the all-reduced o / down
//                            product; null: nothing added), then, with next_weight non-null, the
//                            next norm handed over as rmsnorm.cu's rms_norm_residual_add hands it
//                            over: normed = bf16(hidden * (weight_offset + next_weight)), row_ss =
//                            each 16 columns' sum of squares (chunk_sum_sq), for the prenormed GEMVs
//                            of the fused decode layer. One block per row; hidden_size % 16 == 0.
//   shift_argmax_keys        keys[r] -= vocab_start: the greedy argmax keys of a rank's LM head
//                            (gemv.cu's gemv_prenormed_bf16 keeps them with local ids) made to name
//                            full-vocabulary ids (2^32 - 1 - id in the low word never borrows), so an
//                            all-reduce with max over the ranks names the full row's argmax
//                            (parallel/vocab_parallel.py's shard_argmax_keys is the twin).
//   place_vocab_slice        logits[r, vocab_start + j] = part[r, j] for j < slice: one rank's
//                            logits [rows, slice], as the broadcast delivered them, put into its
//                            columns of the [rows, full vocab] logits the sampler reads (a strided
//                            copy; parallel/vocab_parallel.py's gather_vocab is the twin).
#include "common.cuh"

constexpr int EMBED_THREADS = 128;    // block size of embedding_gather_shard (one block per token)
constexpr int ADD_THREADS = 256;      // block size of residual_add (one block per row)
constexpr int KEY_THREADS = 128;      // block size of shift_argmax_keys
constexpr int PLACE_THREADS = 256;    // block size of place_vocab_slice (grid: column blocks x rows)

extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embedding_gather_shard(
    bf16* __restrict__ out, const bf16* __restrict__ table, const int* __restrict__ token_ids,
    const int* __restrict__ fed_rows, const int* __restrict__ fed_ids, int num_tokens, int hidden,
    int vocab_start, int rows, unsigned long long* __restrict__ head_argmax, float scale) {
    allow_consumer();
    wait_for_producer();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    if (head_argmax && threadIdx.x == 0) head_argmax[t] = 0ull;
    const int fed = fed_rows ? fed_rows[t] : -1;
    const int id = (fed >= 0 ? fed_ids[fed] : token_ids[t]) - vocab_start;
    const bool held = id >= 0 && id < rows;      // an id of another rank's slice, or none: zeros
    const bf16* src = table + (size_t)(held ? id : 0) * hidden;
    bf16* dst = out + (size_t)t * hidden;
    for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (held) raw = *reinterpret_cast<const uint4*>(src + col);
        float v[8];
        unpack_bf16x8(raw, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], scale);
        store_bf16x8(dst + col, v);
    }
}

// hidden and x are earlier kernels' (or NCCL's) outputs: plain loads after wait_for_producer.
extern "C" __global__ void __launch_bounds__(ADD_THREADS) residual_add(
    bf16* hidden, const bf16* x, int num_rows, int hidden_size, float weight_offset,
    const bf16* __restrict__ next_weight, bf16* __restrict__ normed, float* __restrict__ row_ss) {
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.x;
    if (r >= num_rows) return;
    const int chunks = hidden_size / SS_CHUNK;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const size_t at = (size_t)r * hidden_size + c * SS_CHUNK;
        float h[SS_CHUNK], v[SS_CHUNK];
#pragma unroll
        for (int half = 0; half < 2; ++half) unpack_bf16x8(load_fresh(hidden + at + 8 * half), h + 8 * half);
        if (x) {
#pragma unroll
            for (int half = 0; half < 2; ++half) unpack_bf16x8(load_fresh(x + at + 8 * half), v + 8 * half);
#pragma unroll
            for (int i = 0; i < SS_CHUNK; ++i) h[i] = bf16_round(__fadd_rn(h[i], v[i]));
            store_bf16x8(hidden + at, h);
            store_bf16x8(hidden + at + 8, h + 8);
        }
        if (next_weight)   // the next norm's operand and this chunk's sum of squares (embedding.cu's form)
            hand_over_norm_chunk(h, next_weight + c * SS_CHUNK, weight_offset, normed + at, &row_ss[(size_t)r * chunks + c]);
    }
}

extern "C" __global__ void __launch_bounds__(KEY_THREADS) shift_argmax_keys(
    unsigned long long* keys, int num_rows, int vocab_start) {
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < num_rows) keys[r] -= (unsigned long long)vocab_start;
}

// part is the broadcast's output (NCCL's kernel before this one): plain loads after wait_for_producer.
extern "C" __global__ void __launch_bounds__(PLACE_THREADS) place_vocab_slice(
    float* logits, const float* part, int rows, int slice, int vocab_start, int full_vocab) {
    allow_consumer();
    wait_for_producer();
    const int r = blockIdx.y;
    if (r >= rows) return;
    const float* src = part + (size_t)r * slice;
    float* dst = logits + (size_t)r * full_vocab + vocab_start;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < slice; j += gridDim.x * blockDim.x) dst[j] = src[j];
}
