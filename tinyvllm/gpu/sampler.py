"""GPU sampling: one launch of cuda/sampling.cu's `sample_tokens` turns the fp32 logits of every
sequence into one int32 token id each, on the device. Only those S ids go back to the host.

Device buffers the caller provides (arena views; anything with `.ptr`, or an int address):
    logits       float32 [S, vocab] contiguous   (OVERWRITTEN for non-greedy rows with the
                                                   sampling weights e; read logits before)
    temperature  float32 [S]        top_k int32 [S]     top_p float32 [S]
    seed         uint64  [S]        step  int32 [S]     (SamplingBatch's arrays, same dtypes)
    out          int32   [S]        the sampled token ids
Launch: grid (S,), block (1024,): one thread block per sequence, see the kernel's header.
The algorithm, and its numpy twin, are in tinyvllm/sampling.py.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.gpu.kernels import KernelLibrary, register

SAMPLE_THREADS = 1024

register({
    # logits, vocab, temperature, top_k, top_p, seed, step, out
    "sample_tokens": "PiPPPPPP",
})


def _address(buf) -> int:
    return int(buf.ptr) if hasattr(buf, "ptr") else int(buf)


class Sampler:
    def __init__(self, kernels: KernelLibrary):
        self._kernel = kernels["sample_tokens"]

    def sample(self, logits, num_seqs: int, vocab_size: int, temperature, top_k, top_p, seed,
               step, out, stream=None) -> None:
        """Enqueue sampling of rows 0..num_seqs-1 on `stream`; results land in `out`."""
        if num_seqs == 0:
            return
        self._kernel((num_seqs,), (SAMPLE_THREADS,), _address(logits), np.int32(vocab_size),
                     _address(temperature), _address(top_k), _address(top_p), _address(seed),
                     _address(step), _address(out), stream=stream)
