"""ModelRunner: the one interface between the scheduler and a backend. A runner owns the model
weights and the KV cache memory; each step it takes a ForwardBatch (tokens, positions, slots,
block tables) and a SamplingBatch and returns one sampled token id per sequence.

Backends: tinyvllm.reference.numpy_runner.NumpyRunner (device="cpu": the numpy twins, slow but
exact and dependency-free) and tinyvllm.gpu.cuda_runner.CudaRunner (device="cuda"). This module
imports neither: engine/startup.py picks one for the engine's device."""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Callable

import numpy as np

from tinyvllm.engine.batch import ForwardBatch, SamplingBatch, StepLogprobs
from tinyvllm.structured.mask import PendingTokenMask


class PendingStep:
    """A launched step. wait() -> its sampled ids (int32 [S]), the same object on every call."""

    def __init__(self, finish: Callable[[], np.ndarray]):
        self._finish, self._tokens = finish, None

    def wait(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens, self._finish = self._finish(), None
        return self._tokens


def with_mask_resolved(sampling: SamplingBatch) -> SamplingBatch:
    """The sampling inputs with a PendingTokenMask resolved into its TokenMask (the same object
    where there is none)."""
    if not isinstance(sampling.token_mask, PendingTokenMask):
        return sampling
    return dataclasses.replace(sampling, token_mask=sampling.token_mask.resolve())


class ModelRunner(ABC):
    num_kv_blocks: int               # KV cache size in blocks of EngineConfig.block_size tokens
    # True where launch() returns before the step's device work is done, so the host can
    # prepare the next step meanwhile (EngineConfig.async_scheduling's default follows it)
    overlaps_steps: bool = False
    # True where launch() takes a SamplingBatch whose token_mask is a PendingTokenMask
    # (structured/mask.py) and resolves it only when the step samples; where False, the engine
    # launches no constrained step ahead
    takes_pending_token_masks: bool = True
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
        sampling.token_mask may be a PendingTokenMask: the forward needs no mask, so a runner
        starts it at once and resolves the mask just before it samples (at the latest when the
        step is waited for, or when the next step is launched: its fed ids are this step's).
        This default runs execute() when the step is waited for, its fed ids resolved on the
        host and then its mask: the same results without overlap (how the CPU tests drive
        async scheduling)."""
        previous = self._previous
        if batch.fed_rows is not None and previous is None:
            raise ValueError("a step with fed tokens needs a step launched before it")

        def finish() -> np.ndarray:
            resolved = batch if batch.fed_rows is None else batch.with_fed_ids(previous.wait())
            return self.execute(resolved, with_mask_resolved(sampling))
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
