"""CudaRunner: the CUDA backend of the ModelRunner interface (tinyvllm/runner.py).

Start-up, once: CUDA context and stream, kernels compiled (cached on disk), the arena, the
weights, cuBLAS bound to the stream and to a workspace inside the arena, then the KV cache from
whatever memory is left. Per step: write the batch into the arena's page-locked input mirror,
one host-to-device copy into an input bank, the forward pass, sampling, and one copy of S token
ids back.

Steps take the arena's two input banks in turn (StepShape.bank), and a step's inputs go up on a
copy stream of their own, by the copy engine: the upload of step N+1 runs while step N still
computes on the stream (it waits only for step N-1, the last to read that bank), and the stream
waits for it with an event that has long completed. The sampler itself writes the sampled ids
into the bank's page-locked buffer, which is mapped into the device's address space (a posted
PCIe write; sample_tokens' out_host). So between two decode graphs the stream holds nothing but
an event wait and the event the host waits on: measured on an H100, the engine's step then
costs the graph + ~2 us, against + ~8 us when a kernel uploaded the inputs and another brought
the ids down between the graphs (docs/perf-notes.md, session 17). One decode graph per batch
size and bank.

launch() returns once a plain step is enqueued (overlaps_steps: the engine's async scheduling
prepares the next step meanwhile). Two steps may be in flight: each has its own bank and its
own ids buffer; the next one's inputs are written into the mirror only after the last upload
has read it (an event). A step launched ahead gets its fed token ids from `sampled_ids` on the
device, where the step before left them (embedding.cu).

A step whose SamplingBatch has logit edits (penalties, logit_bias, min_tokens), a token mask
(structured outputs) or asks for logprobs takes a longer road, and only such a step does: the
edits' and the mask's uploads on copy streams (beside the forward), the forward alone (eager,
or the decode size's forward-only graph, captured on first use), then — eagerly, each launched
only when needed — apply_token_mask (gpu/structured_ops.py), a device copy of the
raw logits (for logprobs), apply_logit_edits, the same sample_tokens launch as in the graphs,
and step_logprobs on the copy. The logprobs come back
in `last_logprobs`; every other step leaves the captured graph path exactly as it was.
"""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import pycuda.driver as drv  # a missing PyCUDA fails this import: make_runner says so in one line

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, StepLogprobs
from tinyvllm.engine.model_runner import ModelRunner, PendingStep
from tinyvllm.gpu.arena import CUBLAS_WORKSPACE_BYTES, INPUT_BANKS, TOKEN_INPUTS, Arena, ArenaDims, ArenaLayout
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.device_weights import upload_weights
from tinyvllm.gpu.driver import CudaDevice
from tinyvllm.gpu.graphs import CudaGraph
from tinyvllm.gpu.kernels import KernelLibrary
from tinyvllm.gpu.kv_cache import DeviceKVCache, num_blocks_to_allocate
from tinyvllm.gpu.model import LlamaModel, StepShape
from tinyvllm.gpu.ops import GpuOps
from tinyvllm.gpu.structured_ops import TokenMaskStage

log = logging.getLogger("tinyvllm.gpu")
GiB = 2**30


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


class CudaRunner(ModelRunner):
    # logprobs come from the sampler's own kernels (step_logprobs, launched only for steps with a
    # row that asks); prompt logprobs would need every prompt position's logits, which the
    # forward does not keep (it computes the LM head for each sequence's last position only)
    supports_logprobs = True
    supports_prompt_logprobs = False
    overlaps_steps = True

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig):
        self.cfg, self.engine_cfg = config, engine_config
        self.device = CudaDevice()
        self.device_name = self.device.name
        with self.device.active():
            self.stream = drv.Stream()
            self.kernels = KernelLibrary()
            self.dims = ArenaDims.from_configs(config, engine_config)
            self.arena = Arena(ArenaLayout.plan(self.dims))
            self.weights = upload_weights(config, weights)
            self.blas = Cublas(self.stream.handle, int(self.arena.view("cublas_workspace")),
                               CUBLAS_WORKSPACE_BYTES)
            free, total = self.device.memory_info()
            self.num_kv_blocks = num_blocks_to_allocate(config, engine_config, free, total)
            self.kv_cache = DeviceKVCache(config, self.num_kv_blocks, engine_config.block_size)
            log.info("%s: weights %.2f GiB, arena %.2f GiB, KV cache %.2f GiB (%s blocks; "
                     "gpu_memory_utilization %.2f of %.1f GiB)", self.device_name,
                     self.weights.nbytes / GiB, self.arena.layout.total_bytes / GiB,
                     self.kv_cache.nbytes / GiB, f"{self.num_kv_blocks:,}",
                     engine_config.gpu_memory_utilization, total / GiB)
            self.ops = GpuOps(self.kernels, self.stream, self.blas, self.device.num_sms)
            self.model = LlamaModel(config, self.weights, self.arena, self.kv_cache, self.ops)
            self._block_tables_offset = self.arena.layout.inputs["block_tables"].offset
            self._block_tables_flat = self.arena.host_inputs_bytes[self._block_tables_offset:].view(np.int32)
            self.graphs: dict[tuple[int, int], CudaGraph] = {}           # by (batch size, bank)
            self.forward_graphs: dict[tuple[int, int], CudaGraph] = {}   # forward only: steps with edits/logprobs
            self.scratch = GrowingBuffers()
            self.token_masks = TokenMaskStage(self.ops, self.scratch)   # structured outputs' masks
            self.copy_stream = self.edits_uploaded = None      # made on the first step with edits
            self.last_logprobs: StepLogprobs | None = None
            self._graph_sizes: list[int] = []
            # the inputs' copy stream (module docstring); the last upload's end (the mirror is
            # free again, and the stream may run the step); per input bank the point on the
            # stream after which no step reads it, a page-locked buffer for its step's ids and
            # the event of their arrival
            self.upload_stream = drv.Stream()
            self._inputs_uploaded = drv.Event()
            self._inputs_uploaded.record(self.upload_stream)
            self._bank_free = [drv.Event() for _ in range(INPUT_BANKS)]
            for event in self._bank_free:
                event.record(self.stream)
            self._ids_host = [drv.pagelocked_empty(self.dims.seqs, np.int32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
                              for _ in range(INPUT_BANKS)]
            self._ids_host_device_ptrs = [int(b.base.get_device_pointer()) for b in self._ids_host]
            self._ids_ready = [drv.Event() for _ in range(INPUT_BANKS)]
            self._next_bank = 0
            if not engine_config.enforce_eager:
                self.capture_decode_graphs()

    # -- one step ----------------------------------------------------------------------------
    def _stage_inputs(self, batch: ForwardBatch, sampling: SamplingBatch | None, rows: int | None = None) -> StepShape:
        """Write the batch into the page-locked input mirror and upload it into the next input
        bank in one copy on the copy stream; the stream waits for it (module docstring).

        rows > num_seqs pads a decode batch up to a captured graph's size with harmless
        sequences: token 0 at position 0, no KV write (slot -1), context 1 through block 0,
        greedy; their outputs are never read."""
        T, S = batch.num_tokens, batch.num_seqs
        R = rows or S
        self._inputs_uploaded.synchronize()          # the last upload is done with the mirror
        if T > self.dims.tokens or R > self.dims.seqs:
            raise ValueError(f"batch of {T} tokens / {S} sequences exceeds the arena "
                             f"({self.dims.tokens} tokens / {self.dims.seqs} sequences)")
        width = batch.block_tables.shape[1]
        if width > self.dims.blocks_per_seq:
            raise ValueError(f"block table width {width} exceeds {self.dims.blocks_per_seq}")
        h = self.arena.host
        # per-token inputs: a decode step's own short arrays, or the prefill ones (arena.py)
        tok = {name: h(name if batch.is_prefill else f"decode_{name}") for name in TOKEN_INPUTS}
        tok["token_ids"][:T] = batch.token_ids
        tok["positions"][:T] = batch.positions
        tok["slot_mapping"][:T] = batch.slot_mapping
        h("query_start")[:S + 1] = batch.query_start
        h("context_lens")[:S] = batch.context_lens
        h("last_token_idx")[:S] = batch.last_token_indices
        if sampling is None:
            sampling = SamplingBatch.greedy(S)
        h("temperature")[:S] = sampling.temperature
        h("top_k")[:S] = sampling.top_k
        h("top_p")[:S] = sampling.top_p
        h("min_p")[:S] = sampling.min_p
        h("seeds")[:S] = sampling.seed
        h("steps")[:S] = sampling.step
        tok["fed_rows"][:T] = -1 if batch.fed_rows is None else batch.fed_rows
        if R > S:
            assert not batch.is_prefill and T == S, "only decode batches are padded"
            for name, value in (("token_ids", 0), ("fed_rows", -1), ("positions", 0), ("slot_mapping", -1)):
                tok[name][S:R] = value
            for name, value in (("context_lens", 1), ("temperature", 0.0), ("top_k", -1),
                                ("top_p", 1.0), ("min_p", 0.0), ("seeds", 0), ("steps", 0)):
                h(name)[S:R] = value
            h("last_token_idx")[S:R] = np.arange(S, R)
        h("block_table_width")[0] = width
        # packed with this batch's width (the kernels read the width from the arena), so the
        # upload stops right after the rows in use
        self._block_tables_flat[:S * width] = batch.block_tables.reshape(-1)
        self._block_tables_flat[S * width:R * width] = 0
        end = self._token_inputs_end(T) if batch.is_prefill else self._block_tables_offset + R * width * 4
        bank, self._next_bank = self._next_bank, (self._next_bank + 1) % INPUT_BANKS
        # The stream so far ends with the previous step, the last one to read the bank before
        # this one: that bank's free point is here (this bank's was marked banks - 1 steps ago).
        self._bank_free[(bank - 1) % INPUT_BANKS].record(self.stream)
        self.upload_stream.wait_for_event(self._bank_free[bank])
        self.arena.upload_inputs(end, bank, self.upload_stream)
        self._inputs_uploaded.record(self.upload_stream)
        self.stream.wait_for_event(self._inputs_uploaded)
        return StepShape(num_tokens=R if R > S else T, num_seqs=R, is_prefill=batch.is_prefill,
                         max_query_len=int(np.diff(batch.query_start).max()), bank=bank)

    def _token_inputs_end(self, num_tokens: int) -> int:
        """Where a prefill step's upload ends: past the first num_tokens of every prefill
        per-token array (they lie after the block tables, arena.py)."""
        inputs = self.arena.layout.inputs
        return max(inputs[name].offset + num_tokens * 4 for name in TOKEN_INPUTS)

    def _plain_step(self, step: StepShape) -> None:
        """The device work of one plain step, as captured into a decode graph: the forward and
        the sampler, which reads the greedy argmax keys the LM head kept, where it kept them
        (model.head_argmax_for), and writes the ids into the bank's mapped host buffer too."""
        self.model.forward(step)
        self._sample(step, head_argmax=self.model.head_argmax_for(step), ids_host=self._ids_host_device_ptrs[step.bank])

    def _sample(self, step: StepShape, head_argmax: int = 0, ids_host: int = 0) -> None:
        """head_argmax: the LM head's argmax keys of these very logits (not after logit edits);
        ids_host: the mapped page-locked buffer the sampler also writes the ids into (0: none)."""
        v = self.arena.view
        i = lambda name: v(name, step.bank)  # noqa: E731
        self.ops.sample(v("logits"), step.num_seqs, self.cfg.vocab_size, i("temperature"), i("top_k"),
                        i("top_p"), i("seeds"), i("steps"), v("sampled_ids"), min_p=i("min_p"),
                        argmax_partials=v("argmax_partials"), slice_counters=v("argmax_slice_counters"),
                        head_argmax=head_argmax, out_host=ids_host)

    @staticmethod
    def _is_plain(sampling: SamplingBatch | None) -> bool:
        """No logit edits, no logprobs, no token mask: the step is the captured graph and nothing else."""
        return sampling is None or (sampling.edits is None and sampling.logprobs is None
                                    and sampling.token_mask is None)

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch, replay: bool = True) -> PendingStep:
        """Enqueue a plain step and return (its fed tokens read on the device from the step
        enqueued before it); other steps run to the end here (execute)."""
        if not self._is_plain(sampling):
            if batch.fed_rows is not None:
                raise ValueError("only a plain-sampling step can be fed the previous step's ids")
            tokens = self.execute(batch, sampling, replay)
            return PendingStep(lambda: tokens)
        with self.device.active():
            S = batch.num_seqs
            graph_size = None if batch.is_prefill else self._graph_size_for(S)
            replays = graph_size is not None and replay
            step = self._stage_inputs(batch, sampling, rows=graph_size)
            if replays:
                self.graphs[graph_size, step.bank].launch(self.stream)
            else:
                self._plain_step(step)
            ids, ready = self._ids_host[step.bank], self._ids_ready[step.bank]
            ready.record(self.stream)
        self.last_logprobs = None

        def finish() -> np.ndarray:
            with self.device.active():
                ready.synchronize()
            return ids[:S].copy()
        return PendingStep(finish)

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch, replay: bool = True) -> np.ndarray:
        """Forward + sample; returns the int32 [S] next token of each sequence (and sets
        last_logprobs). Decode steps replay the smallest captured graph that holds the batch;
        replay=False runs the very same (padded) launches eagerly instead, which is how tests
        check the graphs."""
        if self._is_plain(sampling):
            return self.launch(batch, sampling, replay).wait()
        if batch.fed_rows is not None:
            raise ValueError("only a plain-sampling step can be fed the previous step's ids")
        with self.device.active():
            S = batch.num_seqs
            graph_size = None if batch.is_prefill else self._graph_size_for(S)
            replays = graph_size is not None and replay
            step = self._stage_inputs(batch, sampling, rows=graph_size)
            edits_dev = self._upload_edits(sampling)       # overlaps the forward
            self.token_masks.upload(sampling.token_mask)   # so does the token mask's
            if replays:
                self._forward_graph(step).launch(self.stream)
            else:
                self.model.forward(step)
            finish = self._process_and_sample(step, sampling, sampling.logprob_rows, edits_dev)
            self.arena.download_outputs(S * 4, self.stream)
            self.stream.synchronize()
            self.last_logprobs = finish() if finish is not None else None
            return self.arena.host("sampled_ids")[:S].copy()

    def _forward_graph(self, step: StepShape) -> CudaGraph:
        """The forward-only graph of a decode size and bank, captured the first time a step with
        edits or logprobs needs it (its kernels were loaded by the full graph's eager warm-up)."""
        key = step.num_seqs, step.bank
        graph = self.forward_graphs.get(key)
        if graph is None:
            self.stream.synchronize()
            with CudaGraph.capture(self.stream) as graph:
                self.model.forward(step)
            self.forward_graphs[key] = graph
        return graph

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

    # -- CUDA graphs for decode ------------------------------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        """1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself)."""
        top = self.dims.seqs
        sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16)) + [top]
        return sorted(set(sizes))

    def _graph_size_for(self, num_seqs: int) -> int | None:
        for size in self._graph_sizes:
            if size >= num_seqs:
                return size
        return None

    def capture_decode_graphs(self) -> None:
        """Capture one plain decode step per batch size and input bank. Each size runs once
        eagerly first, so that cuBLAS picks and loads its kernels outside the capture."""
        start, free_before = time.perf_counter(), self.device.memory_info()[0]
        for size in self.graph_batch_sizes():
            dummy = ForwardBatch.build([[0]] * size, [1] * size, [[0]] * size, self.engine_cfg.block_size,
                                       is_prefill=False)
            dummy.slot_mapping[:] = -1            # write nothing into the KV cache
            for turn in range(INPUT_BANKS):       # the banks come in turn
                step = self._stage_inputs(dummy, None)
                if turn == 0:
                    self._plain_step(step)
                self.stream.synchronize()
                with CudaGraph.capture(self.stream) as graph:
                    self._plain_step(step)
                self.graphs[size, step.bank] = graph
        self.stream.synchronize()
        self._graph_sizes = sorted({size for size, _ in self.graphs})
        log.info("captured %d decode CUDA graphs (batch sizes %d..%d, %d input banks) in %.1f s, taking %.2f GiB",
                 len(self.graphs), self._graph_sizes[0], self._graph_sizes[-1], INPUT_BANKS,
                 time.perf_counter() - start, (free_before - self.device.memory_info()[0]) / GiB)

    def recapture_decode_graphs(self) -> None:
        """Drop every captured graph and capture the decode graphs again. A graph fixes the ops'
        settings (pdl, fuse, fuse_norm, l2_prefetch, early_kv, skip_ops) at capture; the forward-
        only graphs are captured again when next needed."""
        for graph in (*self.graphs.values(), *self.forward_graphs.values()):
            graph.close()
        self.graphs.clear()
        self.forward_graphs.clear()
        with self.device.active():
            self.capture_decode_graphs()

    @contextlib.contextmanager
    def recaptured(self, **ops_settings):
        """The decode graphs captured again with these GpuOps attributes set; on leaving, the old
        values and graphs come back (the GPU tests and benchmarks/decode_profile.py compare
        settings so)."""
        was = {name: getattr(self.ops, name) for name in ops_settings}
        for name, value in ops_settings.items():
            setattr(self.ops, name, value)
        try:
            self.recapture_decode_graphs()
            yield self
        finally:
            for name, value in was.items():
                setattr(self.ops, name, value)
            self.recapture_decode_graphs()

    def forward_logits(self, batch: ForwardBatch) -> np.ndarray:
        """Forward only; copies the fp32 logits [S, vocab] back (tests and debugging)."""
        with self.device.active():
            step = self._stage_inputs(batch, None)
            self.model.forward(step)
            return self._copy_logits(step.num_seqs)

    def memory_report(self) -> str:
        """Everything this runner holds on the GPU: weights, the arena's memory map, the KV cache."""
        kv = self.kv_cache
        return "\n".join([
            f"{self.device_name}: weights {self.weights.nbytes / 2**30:.2f} GiB (q/k/v and gate/up fused)",
            f"KV cache {kv.nbytes / 2**30:.2f} GiB: {kv.num_blocks:,} blocks of {kv.block_size} tokens "
            f"({self.cfg.kv_bytes_per_token:,} bytes per token)",
            f"decode graphs captured for batch sizes {self._graph_sizes or 'none (eager)'}",
            "arena:", str(self.arena)])

    def read_logits(self, num_seqs: int) -> np.ndarray:
        """The fp32 logits [num_seqs, vocab] of the last step (sampled rows hold the sampler's
        weights instead: it works in place)."""
        with self.device.active():
            return self._copy_logits(num_seqs)

    def _copy_logits(self, num_seqs: int) -> np.ndarray:
        self.stream.synchronize()
        out = np.empty((num_seqs, self.cfg.vocab_size), np.float32)
        drv.memcpy_dtoh(out, int(self.arena.view("logits")))
        return out

    def close(self) -> None:
        """Free everything this runner holds on the GPU (graphs, cuBLAS, KV cache, weights,
        arena), so another user of the device — say a baseline in the same process — gets it."""
        if getattr(self, "blas", None) is None:
            return
        with self.device.active():
            for graph in (*self.graphs.values(), *self.forward_graphs.values()):
                graph.close()
            self.graphs, self.forward_graphs, self._graph_sizes = {}, {}, []
            self.scratch.free()
            self.blas.close()
            self.blas = None
            self.stream.synchronize()
            for owner in (self.kv_cache, self.weights, self.arena):
                owner.free()
