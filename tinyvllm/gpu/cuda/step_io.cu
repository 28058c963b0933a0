// A step's host <-> device traffic moved by a kernel instead of the copy engine.
//
// Between two decode graphs the engine moves a few hundred bytes: the step's inputs up from the
// arena's page-locked mirror, the sampled ids down into a page-locked buffer. As copy-engine
// transfers each costs ~10 us of the stream's time whatever its size (measured on the H200,
// docs/perf-notes.md, session 9: +11.0 us for the upload, +9.2 for the download). Page-locked
// host memory that is mapped into the device's address space (CU_MEMHOSTALLOC_DEVICEMAP) can be
// read and written by any kernel over PCIe, so a one-block kernel can do the same move with a
// launch's cost plus one PCIe round trip. Measured on an H100 (benchmarks/decode_profile.py
// --step-copies, Llama-1B, batch 1): the engine's whole step +15.9 us over the graph alone by the
// copy engine, +5.3 by this kernel; `bench` 962-964 -> 974-975 decode tok/s.
//
// copy_words: dst[i] = src[i] for i < n, 4-byte words, either side in device memory or in mapped
// host memory. Launch: grid-stride, THREADS per block (gpu/ops.py's copy_words picks the grid).
// Coalesced: a warp moves 128 consecutive bytes, one PCIe request when a side is host memory.
// Ordering: the kernel never calls wait_for_producer(), so it is never launched under PDL
// (gpu/kernels.py): it starts after everything before it in the stream has finished, and
// whatever comes after it in the stream sees its writes (the end of a kernel is a system-wide
// release: host memory written by it is current once an event after it has completed).
constexpr int THREADS = 256;   // block size (gpu/ops.py launches with it)

extern "C" __global__ void __launch_bounds__(THREADS) copy_words(unsigned* __restrict__ dst,
                                                                 const unsigned* __restrict__ src, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
