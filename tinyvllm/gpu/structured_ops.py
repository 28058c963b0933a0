"""Structured outputs on the GPU: the launcher of gpu/cuda/token_mask.cu and the step's mask upload.

    kernel (gpu/cuda/)             launcher              numpy twin (tinyvllm/reference/)   GPU test (tests/)
    token_mask.cu apply_token_mask apply_token_mask()    sampling.apply_token_mask          test_gpu_token_mask

TokenMaskStage is CudaRunner's part of it. A step whose SamplingBatch has a token_mask (some row
is constrained) takes the runner's longer road, as a step with logit edits does (cuda_runner.py:
the forward alone, then the sampler's kernels one by one): upload() starts the mask's copy on a
copy stream of its own as the forward is enqueued, so the copy runs beside it; apply() makes the
stream wait for the copy and launches apply_token_mask on the logits, first of the sampler's
kernels. The sampler then takes its argmax from the masked logits, never from the keys the LM
head kept of the unmasked ones (CudaRunner._process_and_sample). A step without a mask launches
nothing here: it is the captured graph, exactly as before.
"""
from __future__ import annotations

import math

import numpy as np

from tinyvllm.gpu.kernels import kernel_constants

TOKEN_MASK = kernel_constants("token_mask.cu")


def apply_token_mask(ops, logits, vocab_size: int, rows, bits, words_per_row: int, num_rows: int) -> None:
    """In place on fp32 logits [*, vocab_size]: row rows[j] (int32 [num_rows]) gets -inf at every
    token whose bit in bits[j] (uint32 [num_rows, words_per_row]) is 0. Through GpuOps._launch,
    so an observer (trace.py, decode_profile.py) sees it like any other op. No rows: no launch."""
    if words_per_row * 32 < vocab_size:
        raise ValueError(f"apply_token_mask: {words_per_row} words of bits cannot cover {vocab_size} tokens")
    if num_rows:
        threads = TOKEN_MASK["MASK_THREADS"]
        ops._launch("apply_token_mask", (math.ceil(vocab_size / threads), num_rows), threads,
                    logits, vocab_size, rows, bits, words_per_row, num_rows)


class TokenMaskStage:
    """The pending step's mask: uploaded beside the forward, applied before the sampler."""

    def __init__(self, ops, scratch):
        self.ops, self.scratch = ops, scratch        # scratch: CudaRunner's GrowingBuffers
        self.copy_stream = self.uploaded = None      # made on the first constrained step
        self._pending = None                         # (rows pointer, bits pointer, rows, words)

    def upload(self, token_mask) -> None:
        """Start the copy of a step's TokenMask (structured/mask.py; None: nothing to do) as one
        buffer, rows then bits, on the copy stream."""
        self._pending = None
        if token_mask is None or not token_mask.num_rows:
            return
        import pycuda.driver as drv
        rows = np.ascontiguousarray(token_mask.rows, np.int32)
        bits = np.ascontiguousarray(token_mask.bits, np.int32)
        nbytes = rows.nbytes + bits.nbytes
        host = self.scratch.host("token_mask", nbytes)
        host[:rows.nbytes] = rows.view(np.uint8)
        host[rows.nbytes:] = bits.reshape(-1).view(np.uint8)
        dev = self.scratch.device("token_mask", nbytes)
        if self.copy_stream is None:
            self.copy_stream, self.uploaded = drv.Stream(), drv.Event()
        drv.memcpy_htod_async(dev, host, self.copy_stream)
        self.uploaded.record(self.copy_stream)
        self._pending = (dev, dev + rows.nbytes, len(rows), bits.shape[1])

    def apply(self, stream, logits, vocab_size: int) -> bool:
        """Enqueue apply_token_mask for the uploaded mask on `stream` -> whether a mask was applied
        (then the LM head's argmax keys no longer describe the logits)."""
        if self._pending is None:
            return False
        rows_dev, bits_dev, num_rows, words = self._pending
        self._pending = None
        stream.wait_for_event(self.uploaded)
        apply_token_mask(self.ops, logits, vocab_size, rows_dev, bits_dev, words, num_rows)
        return True
