// Structured outputs' token mask: in each constrained row of the step's logits, every token the
// row's grammar refuses gets -inf, before anything else of the sampler runs, so that whatever
// the sampling rule (greedy, top-k/top-p, min_p, the edits after it) only an allowed token can
// come out. The bits are built on the host each step (tinyvllm/structured/mask.py); numpy twin:
// tinyvllm/reference/sampling.py's apply_token_mask. Launched only for a step with a
// constrained row (gpu/structured_ops.py), so an unconstrained step pays nothing.
//
//   rows[j]                 the batch row of mask row j (j < num_rows)
//   bits[j, w]              bit b of word w: token 32 * w + b is allowed in that row
//   logits[rows[j], t]      -> -inf where token t's bit is 0 (NaN included); left alone where 1
//
// Launch: grid = (ceil(vocab / MASK_THREADS), num_rows), block = MASK_THREADS; thread i of block
// (x, j) owns token x * MASK_THREADS + i of mask row j. MASK_THREADS is a multiple of 32, so
// each warp's 32 tokens are one word of the bits (one broadcast load), and the stores of a warp
// are one coalesced run of a row.
#include "common.cuh"

constexpr int MASK_THREADS = 256;

// logits: written by the LM head before it (PDL: read and written only after the wait)
extern "C" __global__ void __launch_bounds__(MASK_THREADS)
apply_token_mask(float* logits, int vocab, const int* __restrict__ rows,
                 const unsigned* __restrict__ bits, int words_per_row, int num_rows) {
    allow_consumer();
    wait_for_producer();
    const int token = blockIdx.x * MASK_THREADS + threadIdx.x;
    const int j = blockIdx.y;
    if (token >= vocab || j >= num_rows) return;
    const unsigned word = bits[(size_t)j * words_per_row + (token >> 5)];
    if (!((word >> (token & 31)) & 1u)) logits[(size_t)rows[j] * vocab + token] = -INFINITY;
}
