// Token embedding gather: out[t, :] = table[id_t, :], where id_t = token_ids[t], or, for a token
// fed from the step before (async scheduling: fed_rows non-null and fed_rows[t] >= 0), that
// step's sampled id fed_ids[fed_rows[t]] — read here, on the device, because the host has not
// read it back yet when this step is launched (engine/batch.py, "Fed tokens").
// Launch: one block per token, threads stride over the row 16 bytes at a time. Requires
// hidden % 8 == 0. Out-of-range ids produce a zero row rather than a wild read.
#include "common.cuh"

constexpr int THREADS = 128;   // block size (gpu/ops.py launches with it)

extern "C" __global__ void __launch_bounds__(THREADS) embedding_gather(bf16* __restrict__ out, const bf16* __restrict__ table,
                                            const int* __restrict__ token_ids, const int* __restrict__ fed_rows,
                                            const int* __restrict__ fed_ids, int num_tokens,
                                            int hidden, int vocab_size) {
    allow_consumer();
    wait_for_producer();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int fed = fed_rows ? fed_rows[t] : -1;
    // a fed id of -1 (the sampler's non-finite row, thrown away by the engine) is out of range:
    // a zero row, like any other
    const int id = fed >= 0 ? fed_ids[fed] : token_ids[t];
    const bool valid = id >= 0 && id < vocab_size;
    for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid) v = *reinterpret_cast<const uint4*>(table + (size_t)id * hidden + col);
        *reinterpret_cast<uint4*>(out + (size_t)t * hidden + col) = v;
    }
}
