"""CudaRunner: the CUDA backend of the ModelRunner interface (tinyvllm/runner.py).

Start-up, once: CUDA context and stream, kernels compiled (cached on disk), the arena, the
weights, cuBLAS bound to the stream and to a workspace inside the arena, then the KV cache from
whatever memory is left. Per step: write the batch into the arena's page-locked input mirror,
one host-to-device copy, the forward pass, sampling, and one copy of S token ids back.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pycuda.driver as drv  # a missing PyCUDA fails this import: make_runner says so in one line

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.arena import CUBLAS_WORKSPACE_BYTES, Arena, ArenaDims, ArenaLayout
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.device_weights import upload_weights
from tinyvllm.gpu.driver import CudaDevice
from tinyvllm.gpu.graphs import CudaGraph
from tinyvllm.gpu.kernels import KernelLibrary
from tinyvllm.gpu.kv_cache import DeviceKVCache, num_blocks_to_allocate
from tinyvllm.gpu.model import LlamaModel, StepShape
from tinyvllm.gpu.ops import GpuOps

log = logging.getLogger("tinyvllm.gpu")
GiB = 2**30


class CudaRunner:
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
            self.graphs: dict[int, CudaGraph] = {}
            self._graph_sizes: list[int] = []
            if not engine_config.enforce_eager:
                self.capture_decode_graphs()

    # -- one step ----------------------------------------------------------------------------
    def _stage_inputs(self, batch: ForwardBatch, sampling: SamplingBatch | None, rows: int | None = None) -> StepShape:
        """Write the batch into the page-locked input mirror and upload it in one copy.

        rows > num_seqs pads a decode batch up to a captured graph's size with harmless
        sequences: token 0 at position 0, no KV write (slot -1), context 1 through block 0,
        greedy; their outputs are never read."""
        T, S = batch.num_tokens, batch.num_seqs
        R = rows or S
        if T > self.dims.tokens or R > self.dims.seqs:
            raise ValueError(f"batch of {T} tokens / {S} sequences exceeds the arena "
                             f"({self.dims.tokens} tokens / {self.dims.seqs} sequences)")
        width = batch.block_tables.shape[1]
        if width > self.dims.blocks_per_seq:
            raise ValueError(f"block table width {width} exceeds {self.dims.blocks_per_seq}")
        h = self.arena.host
        h("token_ids")[:T] = batch.token_ids
        h("positions")[:T] = batch.positions
        h("slot_mapping")[:T] = batch.slot_mapping
        h("query_start")[:S + 1] = batch.query_start
        h("context_lens")[:S] = batch.context_lens
        h("last_token_idx")[:S] = batch.last_token_indices
        if sampling is None:
            sampling = SamplingBatch.greedy(S)
        h("temperature")[:S] = sampling.temperature
        h("top_k")[:S] = sampling.top_k
        h("top_p")[:S] = sampling.top_p
        h("seeds")[:S] = sampling.seed
        h("steps")[:S] = sampling.step
        if R > S:
            assert not batch.is_prefill and T == S, "only decode batches are padded"
            for name, value in (("token_ids", 0), ("positions", 0), ("slot_mapping", -1),
                                ("context_lens", 1), ("temperature", 0.0), ("top_k", -1),
                                ("top_p", 1.0), ("seeds", 0), ("steps", 0)):
                h(name)[S:R] = value
            h("last_token_idx")[S:R] = np.arange(S, R)
        h("block_table_width")[0] = width
        # packed with this batch's width (the kernels read the width from the arena), so the
        # upload stops right after the rows in use
        self._block_tables_flat[:S * width] = batch.block_tables.reshape(-1)
        self._block_tables_flat[S * width:R * width] = 0
        self.arena.upload_inputs(self._block_tables_offset + R * width * 4, self.stream)
        return StepShape(num_tokens=R if R > S else T, num_seqs=R, is_prefill=batch.is_prefill,
                         max_query_len=int(np.diff(batch.query_start).max()))

    def _forward_and_sample(self, step: StepShape) -> None:
        """The device work of one step, as captured into a decode graph."""
        self.model.forward(step)
        v = self.arena.view
        self.ops.sample(v("logits"), step.num_seqs, self.cfg.vocab_size, v("temperature"), v("top_k"),
                        v("top_p"), v("seeds"), v("steps"), v("sampled_ids"))

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch, replay: bool = True) -> np.ndarray:
        """Forward + sample; returns the int32 [S] next token of each sequence. Decode steps
        replay the smallest captured graph that holds the batch; replay=False runs the very
        same (padded) launches eagerly instead, which is how tests check the graphs."""
        with self.device.active():
            S = batch.num_seqs
            graph_size = None if batch.is_prefill else self._graph_size_for(S)
            step = self._stage_inputs(batch, sampling, rows=graph_size)
            if graph_size is None or not replay:
                self._forward_and_sample(step)
            else:
                self.graphs[graph_size].launch(self.stream)
            self.arena.download_outputs(S * 4, self.stream)
            self.stream.synchronize()
            return self.arena.host("sampled_ids")[:S].copy()

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
        """Capture one decode step per batch size. Each size runs once eagerly first, so that
        cuBLAS picks and loads its kernels outside the capture."""
        start, free_before = time.perf_counter(), self.device.memory_info()[0]
        for size in self.graph_batch_sizes():
            dummy = ForwardBatch.build([[0]] * size, [1] * size, [[0]] * size, self.engine_cfg.block_size,
                                       is_prefill=False)
            dummy.slot_mapping[:] = -1            # write nothing into the KV cache
            step = self._stage_inputs(dummy, None)
            self._forward_and_sample(step)
            self.stream.synchronize()
            with CudaGraph.capture(self.stream) as graph:
                self._forward_and_sample(step)
            self.graphs[size] = graph
        self.stream.synchronize()
        self._graph_sizes = sorted(self.graphs)
        log.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, taking %.2f GiB",
                 len(self.graphs), self._graph_sizes[0], self._graph_sizes[-1],
                 time.perf_counter() - start, (free_before - self.device.memory_info()[0]) / GiB)

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
            for graph in self.graphs.values():
                graph.close()
            self.graphs, self._graph_sizes = {}, []
            self.blas.close()
            self.blas = None
            self.stream.synchronize()
            for owner in (self.kv_cache, self.weights, self.arena):
                owner.free()
