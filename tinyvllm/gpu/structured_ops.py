"""Structured outputs on the GPU: the step's token mask, uploaded and applied (cuda/token_mask.cu,
launched by gpu/ops/sampling.py's apply_token_mask).

TokenMaskStage is CudaRunner's part of it. A step whose SamplingBatch has a token_mask (some row
is constrained) and nothing else beyond plain sampling is launched in two parts
(StepSampling._launch_masked): the forward alone (the decode size's forward-only graph, or
eagerly) at once, then — once the mask is known, which for a step launched ahead is after the
step before is applied (structured/mask.py's PendingTokenMask), while the forward runs —
upload() copies the mask on a copy stream of its own, and apply() makes the stream wait for the
copy and launches apply_token_mask on the logits, first of the sampler's kernels. A step with
logit edits or logprobs as well takes the longer road (step_sampling.py), its mask uploaded
beside the forward. Either way the sampler then takes its argmax from the masked logits, never
from the keys the LM head kept of the unmasked ones. A step without a mask launches nothing
here: it is the captured graph, exactly as before.

With steps in flight the one mask buffer is guarded both ways: the host writes the page-locked
copy only once the last upload has read it, and the copy stream overwrites the device buffer
only after the last apply_token_mask has read it (an event on the stream).
"""
from __future__ import annotations

import numpy as np


class TokenMaskStage:
    """The pending step's mask: uploaded beside the forward, applied before the sampler."""

    def __init__(self, ops, scratch):
        self.ops, self.scratch = ops, scratch        # scratch: CudaRunner's GrowingBuffers
        self.copy_stream = self.uploaded = self.applied = None   # made on the first constrained step
        self._pending = None                         # (rows pointer, bits pointer, rows, words)

    def upload(self, token_mask) -> None:
        """Start the copy of a step's TokenMask (structured/mask.py; None: nothing to do) as one
        buffer, rows then bits, on the copy stream."""
        self._pending = None
        if token_mask is None or not token_mask.num_rows:
            return
        import pycuda.driver as drv
        if self.copy_stream is None:
            # (an event not recorded yet is complete: the first waits pass at once)
            self.copy_stream, self.uploaded, self.applied = drv.Stream(), drv.Event(), drv.Event()
        self.uploaded.synchronize()                  # the last copy is done with the host buffer
        rows = np.ascontiguousarray(token_mask.rows, np.int32)
        bits = np.ascontiguousarray(token_mask.bits, np.int32)
        nbytes = rows.nbytes + bits.nbytes
        host = self.scratch.host("token_mask", nbytes)
        host[:rows.nbytes] = rows.view(np.uint8)
        host[rows.nbytes:] = bits.reshape(-1).view(np.uint8)
        dev = self.scratch.device("token_mask", nbytes)
        self.copy_stream.wait_for_event(self.applied)     # the last apply is done with the device buffer
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
        self.ops.apply_token_mask(logits, vocab_size, rows_dev, bits_dev, words, num_rows)
        self.applied.record(stream)
        return True
