// Token embedding gather: out[t, :] = table[token_ids[t], :].
// Launch: one block per token, threads stride over the row 8 values (16 bytes) at a time.
// Requires hidden % 8 == 0. Out-of-range ids produce a zero row rather than a wild read.
#include "common.cuh"

constexpr int THREADS = 128;   // block size (gpu/ops.py launches with it)

extern "C" __global__ void __launch_bounds__(THREADS) embedding_gather(bf16* __restrict__ out, const bf16* __restrict__ table,
                                            const int* __restrict__ token_ids, int num_tokens,
                                            int hidden, int vocab_size) {
    wait_for_producer();
    allow_consumer();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int id = token_ids[t];
    const bool valid = id >= 0 && id < vocab_size;
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid) v = *reinterpret_cast<const uint4*>(table + (size_t)id * hidden + c);
        *reinterpret_cast<uint4*>(out + (size_t)t * hidden + c) = v;
    }
}
