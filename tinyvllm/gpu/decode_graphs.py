"""The runner's decode CUDA graphs (part of CudaRunner): one plain decode step (forward and
sampler) captured per batch size and input bank, replayed for every decode step of that size;
and, captured on first use, the forward-only graphs of the steps that take the longer road
(logit edits or logprobs: gpu/step_sampling.py).

A graph fixes everything at capture: the kernels' arguments (so every per-step value lives in
the arena's input banks) and the GpuOps settings (pdl, fused_decode, skip_ops).
"""
from __future__ import annotations

import contextlib
import logging
import time

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.gpu.arena import INPUT_BANKS
from tinyvllm.gpu.graphs import CudaGraph
from tinyvllm.gpu.step_shape import StepShape

log = logging.getLogger("tinyvllm.gpu")
GiB = 2**30


class DecodeGraphs:
    """CudaRunner's decode graphs: self.graphs by (batch size, bank), self.forward_graphs the
    same for the forward alone. _init_decode_graphs() makes the (empty) tables."""

    def _init_decode_graphs(self) -> None:
        self.graphs: dict[tuple[int, int], CudaGraph] = {}           # by (batch size, bank)
        self.forward_graphs: dict[tuple[int, int], CudaGraph] = {}   # forward only: steps with edits/logprobs
        self._graph_sizes: list[int] = []

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
        """Drop every captured graph and capture the decode graphs again (with the GpuOps
        settings as they are now); the forward-only graphs are captured again when next needed."""
        self._close_graphs()
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

    def _close_graphs(self) -> None:
        for graph in (*self.graphs.values(), *self.forward_graphs.values()):
            graph.close()
        self.graphs.clear()
        self.forward_graphs.clear()
