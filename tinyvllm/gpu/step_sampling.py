"""The runner's sampling after the forward (part of CudaRunner).

A plain step (no logit edits, no logprobs, no token mask) samples inside its captured graph: sample_tokens
reads the greedy argmax keys the LM head kept, where it kept them, and writes the ids into the
bank's mapped host buffer too (gpu/input_banks.py).

A step whose SamplingBatch has logit edits (penalties, logit_bias, min_tokens), a token mask
(structured outputs) or asks for logprobs takes a longer road, and only such a step does: the
edits' and the mask's uploads on copy streams (beside the forward), the forward alone (eager, or
the decode size's forward-only graph), then — eagerly, each launched only when needed —
apply_token_mask (gpu/structured_ops.py), a device copy of the raw logits (for logprobs),
apply_logit_edits, the same sample_tokens launch as in the graphs, and step_logprobs on the
copy. The logprobs come back in `last_logprobs`.
"""
from __future__ import annotations

import numpy as np
import pycuda.driver as drv

from tinyvllm.engine.batch import SamplingBatch, StepLogprobs
from tinyvllm.gpu.model import StepShape
from tinyvllm.gpu.structured_ops import TokenMaskStage


class GrowingBuffers:
    """Device buffers and page-locked host buffers by name, allocated on first use and grown
    (to the next power of two) when a step needs more: the optional sampler steps' inputs and
    outputs, whose sizes (edit entries, logprob rows) are unbounded by the arena's dims."""

    def __init__(self):
        self._device: dict[str, tuple] = {}          # name -> (allocation, its size in bytes)
        self._host: dict[str, np.ndarray] = {}

    @staticmethod
    def _size(nbytes: int) -> int:
        return 1 << max(12, (max(nbytes, 1) - 1).bit_length())

    def device(self, name: str, nbytes: int) -> int:
        held = self._device.get(name)
        if held is None or held[1] < nbytes:
            if held is not None:
                held[0].free()
            size = self._size(nbytes)
            held = self._device[name] = (drv.mem_alloc(size), size)
        return int(held[0])

    def host(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._host.get(name)
        if buf is None or len(buf) < nbytes:
            buf = self._host[name] = drv.pagelocked_empty(self._size(nbytes), np.uint8)
        return buf[:nbytes]

    def free(self) -> None:
        for allocation, _ in self._device.values():
            allocation.free()
        self._device, self._host = {}, {}


class StepSampling:
    """CudaRunner's sampling: _init_step_sampling() makes its scratch buffers (the copy stream
    for edits comes with the first step that has some)."""

    def _init_step_sampling(self) -> None:
        self.scratch = GrowingBuffers()
        self.token_masks = TokenMaskStage(self.ops, self.scratch)   # structured outputs' masks
        self.copy_stream = self.edits_uploaded = None      # made on the first step with edits
        self.last_logprobs: StepLogprobs | None = None

    @staticmethod
    def _is_plain(sampling: SamplingBatch | None) -> bool:
        """No logit edits, no logprobs, no token mask: the step is the captured graph and nothing else."""
        return sampling is None or (sampling.edits is None and sampling.logprobs is None
                                    and sampling.token_mask is None)

    def _sample(self, step: StepShape, head_argmax: int = 0, ids_host: int = 0) -> None:
        """head_argmax: the LM head's argmax keys of these very logits (not after logit edits);
        ids_host: the mapped page-locked buffer the sampler also writes the ids into (0: none)."""
        v = self.arena.view
        i = lambda name: v(name, step.bank)  # noqa: E731
        self.ops.sample(v("logits"), step.num_seqs, self.cfg.vocab_size, i("temperature"), i("top_k"),
                        i("top_p"), i("seeds"), i("steps"), v("sampled_ids"), min_p=i("min_p"),
                        argmax_partials=v("argmax_partials"), slice_counters=v("argmax_slice_counters"),
                        head_argmax=head_argmax, out_host=ids_host)

    def _upload_edits(self, sampling: SamplingBatch) -> int | None:
        """Start the step's LogitEdits upload on a copy stream, so that it runs beside the
        forward pass (at batch 256 with ~1,200 distinct tokens per row it is ~10 MB);
        apply_logit_edits waits for it. -> the device buffer, or None without edits."""
        edits = sampling.edits
        if edits is None or not edits.num_entries:
            return None
        packed = edits.packed().reshape(-1).view(np.uint8)
        host = self.scratch.host("edits", packed.nbytes)
        host[:] = packed
        dev = self.scratch.device("edits", packed.nbytes)
        if self.copy_stream is None:
            self.copy_stream, self.edits_uploaded = drv.Stream(), drv.Event()
        drv.memcpy_htod_async(dev, host, self.copy_stream)
        self.edits_uploaded.record(self.copy_stream)
        return dev

    def _process_and_sample(self, step: StepShape, sampling: SamplingBatch, lp_rows: np.ndarray,
                            edits_dev: int | None):
        """After the forward: [raw logits copy] -> [apply_logit_edits] -> sample_tokens ->
        [step_logprobs], enqueued on the stream. -> a callable that, once the stream is synced,
        returns the StepLogprobs (or None)."""
        v, V, buf = self.arena.view, self.cfg.vocab_size, self.scratch
        masked = self.token_masks.apply(self.stream, v("logits"), V)   # structured outputs, first
        R = len(lp_rows)
        if R:
            raw_bytes = (int(lp_rows.max()) + 1) * V * 4        # rows up to the last that asked
            raw = buf.device("raw_logits", raw_bytes)
            drv.memcpy_dtod_async(raw, int(v("logits")), raw_bytes, self.stream)
        if edits_dev is not None:
            self.stream.wait_for_event(self.edits_uploaded)
            self.ops.apply_logit_edits(v("logits"), V, edits_dev, sampling.edits.num_entries)
        # edited or masked logits are not the ones the LM head took its argmax keys of
        unchanged = edits_dev is None and not masked
        self._sample(step, head_argmax=self.model.head_argmax_for(step) if unchanged else 0)
        if not R:
            return None
        k = sampling.logprob_k
        rows_host = buf.host("logprob_rows", R * 4)
        rows_host[:] = lp_rows.astype(np.int32).view(np.uint8)
        rows_dev = buf.device("logprob_rows", R * 4)
        drv.memcpy_htod_async(rows_dev, rows_host, self.stream)
        out_bytes = R * (2 + 2 * k) * 4
        out = buf.device("logprobs_out", out_bytes)
        self.ops.step_logprobs(raw, V, R, v("sampled_ids"), k, out, out + 4 * R, out + 8 * R,
                               out + (8 + 4 * k) * R, rows=rows_dev)
        host_out = buf.host("logprobs_out", out_bytes)
        drv.memcpy_dtoh_async(host_out, out, self.stream)

        def finish() -> StepLogprobs:
            words = host_out.view(np.int32)
            return StepLogprobs(rows=lp_rows.astype(np.int32).copy(),
                                sampled_logprob=words[:R].view(np.float32).copy(),
                                sampled_rank=words[R:2 * R].copy(),
                                top_ids=words[2 * R:(2 + k) * R].reshape(R, k).copy(),
                                top_logprobs=words[(2 + k) * R:(2 + 2 * k) * R].view(np.float32).reshape(R, k).copy())
        return finish
