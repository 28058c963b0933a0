"""CudaRunner: the CUDA backend of the ModelRunner interface (engine/model_runner.py).

Start-up, once: CUDA context and stream, kernels compiled (cached on disk), the arena, the
weights, cuBLAS bound to the stream and to a workspace inside the arena, then the KV cache from
whatever memory is left, the launchers (GpuOps, with EngineConfig's fused_decode and pdl) and the
model; then the decode graphs. Per step: write the batch into the arena's page-locked input
mirror, one host-to-device copy into an input bank, the forward pass, sampling, and the S token
ids back. The runner's parts live beside it:
    gpu/input_banks.py     the inputs' road to the device and the ids' road back (two banks)
    gpu/decode_graphs.py   one captured decode step per batch size and bank
    gpu/step_sampling.py   sampling: a token mask's two-part launch, and the longer road of steps
                           with logit edits or logprobs

launch() returns once a plain step is enqueued (overlaps_steps: the engine's async scheduling
prepares the next step meanwhile), and so does a step whose only extra is a token mask: its
forward is enqueued, its mask (a PendingTokenMask when launched ahead) uploaded and its sampler
enqueued behind the forward once the mask is known (step_sampling.py). A step launched ahead
gets its fed token ids from `sampled_ids` on the device, where the step before left them
(embedding.cu).

A prefill-kind batch (is_prefill) runs eagerly, whatever its rows: prompts, prompt chunks, and in
a mixed step (engine/scheduler.py) decode rows beside them, each a one-token query at the end of
its context (gpu/model.py). The LM head and the sampler take one row per sequence (its last
token); a chunk that does not end its prompt samples a token nobody reads (postprocess skips it;
the host neither builds its token mask, step_token_mask, nor keeps its logprobs,
append_step_logprobs): one row of a step at most. Decode-only batches keep the captured graphs.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pycuda.driver as drv  # a missing PyCUDA fails this import: make_runner says so in one line

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner, PendingStep, with_mask_resolved
from tinyvllm.gpu.arena import CUBLAS_WORKSPACE_BYTES, Arena, ArenaDims, ArenaLayout
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.decode_graphs import DecodeGraphs
from tinyvllm.gpu.device_weights import upload_weights
from tinyvllm.gpu.driver import CudaDevice
from tinyvllm.gpu.input_banks import InputBanks
from tinyvllm.gpu.kernels import KernelLibrary
from tinyvllm.gpu.kv_cache import DeviceKVCache, num_blocks_to_allocate
from tinyvllm.gpu.model import LlamaModel
from tinyvllm.gpu.ops import GpuOps
from tinyvllm.gpu.step_sampling import StepSampling
from tinyvllm.gpu.step_shape import StepShape

log = logging.getLogger("tinyvllm.gpu")
GiB = 2**30


class CudaRunner(InputBanks, DecodeGraphs, StepSampling, ModelRunner):
    # logprobs come from the sampler's own kernels (step_logprobs, launched only for steps with a
    # row that asks); prompt logprobs would need every prompt position's logits, which the
    # forward does not keep (it computes the LM head for each sequence's last position only)
    supports_logprobs = True
    supports_prompt_logprobs = False
    overlaps_steps = True

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig,
                 sampled_vocab: int | None = None):
        # sampled_vocab: the vocabulary the sampler sees and the arena's logits hold, the full one
        # where a tensor-parallel rank's LM head holds a slice (gpu/tp_layer.py); the model keeps config
        self.cfg = dataclasses.replace(config, vocab_size=sampled_vocab) if sampled_vocab else config
        self.engine_cfg = engine_config
        self.device = CudaDevice()
        self.device_name = self.device.name
        with self.device.active():
            self.stream = drv.Stream()
            self.kernels = KernelLibrary()
            self.dims = ArenaDims.from_configs(self.cfg, engine_config)
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
            self.ops = GpuOps(self.kernels, self.stream, self.blas, self.device.num_sms,
                              fused_decode=engine_config.fused_decode, pdl=engine_config.pdl)
            self.model = LlamaModel(config, self.weights, self.arena, self.kv_cache, self.ops)
            self._init_input_banks()
            self._init_decode_graphs()
            self._init_step_sampling()
            if not engine_config.enforce_eager:
                self.capture_decode_graphs()

    # -- one step ----------------------------------------------------------------------------
    def _plain_step(self, step: StepShape) -> None:
        """The device work of one plain step, as captured into a decode graph: the forward and
        the sampler, which reads the greedy argmax keys the LM head kept, where it kept them
        (model.head_argmax_for), and writes the ids into the bank's mapped host buffer too."""
        self.model.forward(step)
        self._sample(step, head_argmax=self.model.head_argmax_for(step), ids_host=self._ids_host_device_ptrs[step.bank])

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch, replay: bool = True) -> PendingStep:
        """Enqueue a plain or masked-only step and return (its fed tokens read on the device from
        the step enqueued before it); other steps run to the end here (execute)."""
        self._sample_unsampled()
        if self._masks_only(sampling):
            return self._launch_masked(batch, sampling, replay)
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
        if self._is_plain(sampling) or self._masks_only(sampling):
            return self.launch(batch, sampling, replay).wait()
        if batch.fed_rows is not None:
            raise ValueError("only a plain-sampling step can be fed the previous step's ids")
        self._sample_unsampled()
        sampling = with_mask_resolved(sampling)
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

    def forward_logits(self, batch: ForwardBatch) -> np.ndarray:
        """Forward only; copies the fp32 logits [S, vocab] back (tests and debugging)."""
        self._sample_unsampled()
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
        self._unsampled = None
        with self.device.active():
            self._close_graphs()
            self._graph_sizes = []
            self.scratch.free()
            self.blas.close()
            self.blas = None
            self.stream.synchronize()
            for owner in (self.kv_cache, self.weights, self.arena):
                owner.free()
