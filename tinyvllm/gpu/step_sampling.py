"""The runner's sampling after the forward (part of CudaRunner).

A plain step (no logit edits, no logprobs, no token mask) samples inside its captured graph: sample_tokens
reads the greedy argmax keys the LM head kept, where it kept them, and writes the ids into the
bank's mapped host buffer too (gpu/input_banks.py).

A step whose only extra is a token mask (structured outputs) is launched in two parts
(_launch_masked): its forward at once (the decode size's forward-only graph, or eagerly), then
the mask's upload, apply_token_mask and sample_tokens (gpu/structured_ops.py) once the mask is
known. A step launched ahead carries a PendingTokenMask (structured/mask.py) that the engine
resolves once the step before is applied, so the host computes the mask while the GPU runs the
forward; the sampler goes behind the forward on the stream as soon as it is resolved, and at the
latest before the next step is staged or this one is waited for (_sample_unsampled): the next
step reads this one's ids, its input bank and the logits after it. Such a step may be fed the
step before's ids like a plain one.

A step whose SamplingBatch has logit edits (penalties, logit_bias, min_tokens) or asks for
logprobs takes a longer road, and only such a step does: the edits' and the mask's uploads on
copy streams (beside the forward), the forward alone (eager, or the decode size's forward-only
graph), then — eagerly, each launched only when needed — apply_token_mask, a device copy of the
raw logits (for logprobs), apply_logit_edits, the same sample_tokens launch as in the graphs,
and step_logprobs on the copy. The logprobs come back in `last_logprobs`.
"""
from __future__ import annotations

import numpy as np
import pycuda.driver as drv

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, StepLogprobs
from tinyvllm.engine.model_runner import PendingStep
from tinyvllm.gpu.step_shape import StepShape
from tinyvllm.gpu.structured_ops import TokenMaskStage
from tinyvllm.structured.mask import PendingTokenMask


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
        self._unsampled: PendingTokenMask | None = None    # the launched step still to sample

    @staticmethod
    def _is_plain(sampling: SamplingBatch | None) -> bool:
        """No logit edits, no logprobs, no token mask: the step is the captured graph and nothing else."""
        return sampling is None or (sampling.edits is None and sampling.logprobs is None
                                    and sampling.token_mask is None)

    @staticmethod
    def _masks_only(sampling: SamplingBatch | None) -> bool:
        """A token mask and otherwise plain sampling: the step is launched in two parts."""
        return (sampling is not None and sampling.token_mask is not None and sampling.edits is None
                and sampling.logprobs is None)

    def _launch_masked(self, batch: ForwardBatch, sampling: SamplingBatch, replay: bool) -> PendingStep:
        """The forward now; the mask, apply_token_mask and the sampler once the mask is known
        (the module docstring). The caller has sampled the step before (_sample_unsampled)."""
        S = batch.num_seqs
        with self.device.active():
            graph_size = None if batch.is_prefill else self._graph_size_for(S)
            step = self._stage_inputs(batch, sampling, rows=graph_size)
            if graph_size is not None and replay:
                self._forward_graph(step).launch(self.stream)
            else:
                self.model.forward(step)
        self.last_logprobs = None
        ids, ready = self._ids_host[step.bank], self._ids_ready[step.bank]

        def sample(mask) -> None:
            self._unsampled = None
            with self.device.active():
                self.token_masks.upload(mask)
                masked = self.token_masks.apply(self.stream, self.arena.view("logits"), self.cfg.vocab_size)
                # masked logits are not the ones the LM head took its argmax keys of
                self._sample(step, head_argmax=0 if masked else self.model.head_argmax_for(step),
                             ids_host=self._ids_host_device_ptrs[step.bank])
                ready.record(self.stream)
        pending = sampling.token_mask
        if isinstance(pending, PendingTokenMask):
            self._unsampled = pending
            pending.on_resolved(sample)
        else:
            sample(pending)

        def finish() -> np.ndarray:
            if isinstance(pending, PendingTokenMask):
                pending.resolve()                  # nobody did yet: its sampler goes on now
            with self.device.active():
                ready.synchronize()
            return ids[:S].copy()
        return PendingStep(finish)

    def _sample_unsampled(self) -> None:
        """Enqueue the sampler of the step launched last, if its mask is still to come (computed
        now): what follows on the stream reads its ids, its input bank or the logits."""
        if self._unsampled is not None:
            self._unsampled.resolve()

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
