"""ModelRunner: the one interface between the scheduler and a backend. A runner owns the model
weights and the KV cache memory; each step it takes a ForwardBatch (tokens, positions, slots,
block tables) and a SamplingBatch and returns one sampled token id per sequence.

Backends: tinyvllm.reference.numpy_runner.NumpyRunner (device="cpu": the numpy twins, slow but
exact and dependency-free) and tinyvllm.gpu.cuda_runner.CudaRunner (device="cuda")."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, StepLogprobs
from tinyvllm.errors import GPUUnavailableError, TinyVLLMError


class ModelRunner(ABC):
    num_kv_blocks: int               # KV cache size in blocks of EngineConfig.block_size tokens
    # Set by every execute(): the raw logprobs of the rows whose SamplingBatch.logprobs asked
    # for them (rows, sampled logprob and rank, top ids and logprobs), None when none did.
    last_logprobs: StepLogprobs | None = None

    @abstractmethod
    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        """Run the batch's new tokens through the model (writing their K/V into the cache at
        batch.slot_mapping) and sample -> int32 [S]: the next token of each sequence, or -1
        (reference.sampling.NON_FINITE) where its logits were not finite. Raising means the
        runner is unusable (the engine dies; see engine/llm_engine.py)."""

    # logprobs (SamplingParams.logprobs / prompt_logprobs) need the model's raw logits; a runner
    # that cannot give them says so here, and add_request refuses such requests on it.
    supports_logprobs: bool = False
    supports_prompt_logprobs: bool = False

    def step_logits(self) -> np.ndarray:
        """float32 [S, vocab]: the logits of the last execute(), as the model produced them
        (before the sampler), row i for sequence i."""
        raise NotImplementedError(f"{type(self).__name__} keeps no logits")

    def step_logprobs(self, rows: list[int], sampled_ids: np.ndarray, k: int):
        """The logprobs of the last execute()'s sampled tokens, for batch rows `rows` ->
        (sampled_logprob float32 [R], sampled_rank int [R], top_ids int32 [R, k],
        top_logprobs float32 [R, k]): vLLM V1's raw logprobs (log_softmax of the model's
        logits), top ids in descending order. This default computes them on the host from
        step_logits() (output_processor.step_logprobs, the numpy twin) unless the sampler already
        returned them in `last_logprobs` (both runners' samplers do, for the rows whose
        SamplingBatch asked: engine/batch.py StepLogprobs)."""
        last = getattr(self, "last_logprobs", None)
        if last is not None:
            return logprobs_of_rows(last, rows, k)
        from tinyvllm.engine.output_processor import sampled_ranks, step_logprobs
        logits = self.step_logits()[rows]
        sampled, top_ids, top_lps = step_logprobs(logits, sampled_ids, k)
        return sampled, sampled_ranks(logits, sampled_ids), top_ids, top_lps

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the logits at every position of a prompt."""
        raise NotImplementedError(f"{type(self).__name__} computes no prompt logits")

    def close(self) -> None:
        """Release the backend's memory. The runner is unusable afterwards."""


def logprobs_of_rows(last, rows: list[int], k: int):
    """ModelRunner.step_logprobs's answer taken from the sampler's StepLogprobs (`last`, whose
    row j is batch row last.rows[j]) for the batch rows `rows`, top-k columns cut to k."""
    where = {int(r): j for j, r in enumerate(last.rows)}
    missing = [r for r in rows if r not in where]
    if missing:
        raise RuntimeError(f"the sampler returned no logprobs for batch rows {missing}")
    pick = [where[r] for r in rows]
    return (last.sampled_logprob[pick], last.sampled_rank[pick], last.top_ids[pick, :k],
            last.top_logprobs[pick, :k])


def make_runner(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig) -> ModelRunner:
    if engine_config.device == "cpu":
        from tinyvllm.reference.numpy_runner import NumpyRunner
        return NumpyRunner(config, weights, engine_config)
    try:
        from tinyvllm.gpu.cuda_runner import CudaRunner
    except ImportError as e:
        if (e.name or "").startswith("pycuda"):
            raise GPUUnavailableError("PyCUDA is not installed: use --device cpu, or install the "
                                      "gpu extra (pip install -e '.[gpu]')") from None
        raise GPUUnavailableError(f"the CUDA backend cannot be loaded ({e}); use --device cpu") from None
    try:
        return CudaRunner(config, weights, engine_config)
    except TinyVLLMError:
        raise
    except Exception as e:  # noqa: BLE001 — driver errors come as pycuda's own exception types
        if type(e).__module__.startswith("pycuda"):
            raise GPUUnavailableError(f"CUDA start-up failed ({e}); use --device cpu") from None
        raise
