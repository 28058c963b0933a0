"""ModelRunner: the one interface between the scheduler and a backend. A runner owns the model
weights and the KV cache memory; each step it takes a ForwardBatch (tokens, positions, slots,
block tables) and a SamplingBatch and returns one sampled token id per sequence.

Backends: tinyvllm.reference.numpy_runner.NumpyRunner (device="cpu": the numpy twins, slow but
exact and dependency-free) and tinyvllm.gpu.cuda_runner.CudaRunner (device="cuda")."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, StepLogprobs
from tinyvllm.errors import GPUUnavailableError, TinyVLLMError


class PendingStep:
    """A launched step. wait() -> its sampled ids (int32 [S]), the same object on every call."""

    def __init__(self, finish: Callable[[], np.ndarray]):
        self._finish, self._tokens = finish, None

    def wait(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens, self._finish = self._finish(), None
        return self._tokens


class ModelRunner(ABC):
    num_kv_blocks: int               # KV cache size in blocks of EngineConfig.block_size tokens
    # True where launch() returns before the step's device work is done, so the host can
    # prepare the next step meanwhile (EngineConfig.async_scheduling's default follows it)
    overlaps_steps: bool = False
    _previous: PendingStep | None = None     # the step launch() started last
    # Set by every execute(): the raw logprobs of the rows whose SamplingBatch.logprobs asked
    # for them (rows, sampled logprob and rank, top ids and logprobs), None when none did.
    last_logprobs: StepLogprobs | None = None

    @abstractmethod
    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        """Run the batch's new tokens through the model (writing their K/V into the cache at
        batch.slot_mapping) and sample -> int32 [S]: the next token of each sequence, or -1
        (reference.sampling.NON_FINITE) where its logits were not finite. Raising means the
        runner is unusable (the engine dies; see engine/llm_engine.py)."""

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch) -> PendingStep:
        """Start a step and return at once; the step's fed tokens (batch.fed_rows) are the
        sampled ids of the step launched just before it. Steps finish in launch order.
        This default runs execute() when the step is waited for, its fed ids resolved on the
        host: the same results without overlap (how the CPU tests drive async scheduling)."""
        previous = self._previous
        if batch.fed_rows is not None and previous is None:
            raise ValueError("a step with fed tokens needs a step launched before it")

        def finish() -> np.ndarray:
            resolved = batch if batch.fed_rows is None else batch.with_fed_ids(previous.wait())
            return self.execute(resolved, sampling)
        self._previous = step = PendingStep(finish)
        return step

    # logprobs (SamplingParams.logprobs / prompt_logprobs) need the model's raw logits; a runner
    # that cannot give them says so here, and add_request refuses such requests on it.
    supports_logprobs: bool = False
    supports_prompt_logprobs: bool = False

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the logits at every position of a prompt."""
        raise NotImplementedError(f"{type(self).__name__} computes no prompt logits")

    def close(self) -> None:
        """Release the backend's memory. The runner is unusable afterwards."""


def logprobs_of_rows(last: StepLogprobs | None, rows: list[int], k: int):
    """The logprobs of batch rows `rows`, out of a runner's last_logprobs (`last`, whose row j is
    batch row last.rows[j]) -> (sampled_logprob float32 [R], sampled_rank int32 [R], top_ids
    int32 [R, k], top_logprobs float32 [R, k]), top-k columns cut to k."""
    if last is None:
        raise RuntimeError("the last step computed no logprobs")
    where = {int(r): j for j, r in enumerate(last.rows)}
    missing = [r for r in rows if r not in where]
    if missing:
        raise RuntimeError(f"the sampler returned no logprobs for batch rows {missing}")
    pick = [where[r] for r in rows]
    return (last.sampled_logprob[pick], last.sampled_rank[pick], last.top_ids[pick, :k],
            last.top_logprobs[pick, :k])


def runner_class(engine_config: EngineConfig) -> type:
    """The runner class of engine_config's device; a backend that cannot be loaded is a one-line
    error (LLMEngine asks before the default model's first conversion, which takes seconds)."""
    if engine_config.device == "cpu":
        from tinyvllm.reference.numpy_runner import NumpyRunner
        return NumpyRunner
    try:
        from tinyvllm.gpu.cuda_runner import CudaRunner
    except ImportError as e:
        if (e.name or "").startswith("pycuda"):
            raise GPUUnavailableError("PyCUDA is not installed: use --device cpu, or install the "
                                      "gpu extra (pip install -e '.[gpu]')") from None
        raise GPUUnavailableError(f"the CUDA backend cannot be loaded ({e}); use --device cpu") from None
    return CudaRunner


def make_runner(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig) -> ModelRunner:
    try:
        return runner_class(engine_config)(config, weights, engine_config)
    except TinyVLLMError:
        raise
    except Exception as e:  # noqa: BLE001 — driver errors come as pycuda's own exception types
        if type(e).__module__.startswith("pycuda"):
            raise GPUUnavailableError(f"CUDA start-up failed ({e}); use --device cpu") from None
        raise
