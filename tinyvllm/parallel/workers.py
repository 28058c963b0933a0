"""One process per rank: the engine process keeps the scheduler and the tokenizer; each rank
process (multiprocessing spawn: a fresh interpreter, so a CUDA context of its own) sees only its
own GPU (CUDA_VISIBLE_DEVICES), reads the checkpoint itself, keeps its shards
(parallel/sharding.py), and runs its own runner (gpu/cuda_runner.py: its own arena, cuBLAS
handle, weights and KV cache) with an NCCL communicator over the ranks (gpu/nccl.py; the unique
id is made here and sent to every rank).

Each step the engine sends the step's inputs (ForwardBatch, SamplingBatch) to every rank down its
pipe; every rank launches it and answers with its sampled ids; the engine reads rank 0's.
A rank launches the next step as soon as it arrives, before it reads the last one back, so a
runner that overlaps steps (cuda) still does. Steps are answered in launch order; a step the
engine never waits for (one launched ahead, then thrown away) is read and dropped when a later
one is waited for.

A rank that fails at start-up sends its error (a TinyVLLMError is raised again here as itself);
one that fails in a step, or dies, makes the step raise, and the engine dies as on a CUDA error.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
from collections import deque
from pathlib import Path

import numpy as np

from tinyvllm import errors
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner, PendingStep

log = logging.getLogger("tinyvllm.parallel")
START_TIMEOUT_S = 1800.0         # a rank reading, quantizing and uploading a large checkpoint


def uses_rank_processes(engine_config: EngineConfig) -> bool:
    """cuda with an explicit tensor_parallel_size (1 included: one rank process, one-rank NCCL)."""
    return engine_config.device == "cuda" and engine_config.tensor_parallel_size is not None


def rank_devices(size: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each rank: the r-th device this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(r) for r in range(size)]
    return devices[:size]


class RankProcesses(ModelRunner):
    """The ModelRunner of a tensor-parallel group: one process per rank."""
    takes_pending_token_masks = False    # a step goes down the pipes whole, its mask already made

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, model_dir: Path, gguf_file: Path | None):
        size = engine_config.tensor_parallel_size
        unique_id = None
        if engine_config.device == "cuda":
            from tinyvllm.gpu.nccl import new_unique_id
            unique_id = new_unique_id()
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        self._unanswered: deque[_Step] = deque()
        for rank, device in enumerate(rank_devices(size)):
            ours, theirs = context.Pipe()
            process = context.Process(target=rank_main, name=f"tinyvllm-rank{rank}", daemon=True,
                                      args=(theirs, rank, device, config, engine_config, model_dir, gguf_file, unique_id))
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        try:
            ready = [self._receive(rank, START_TIMEOUT_S) for rank in range(size)]
        except BaseException:
            self.close()
            raise
        self.num_kv_blocks = min(r["num_kv_blocks"] for r in ready)
        self.overlaps_steps = ready[0]["overlaps_steps"]
        self.supports_logprobs = ready[0]["supports_logprobs"]
        self.supports_prompt_logprobs = ready[0]["supports_prompt_logprobs"]

    def _receive(self, rank: int, timeout: float | None = None):
        pipe = self.pipes[rank]
        if timeout is not None and not pipe.poll(timeout):
            raise RuntimeError(f"rank {rank} did not answer in {timeout:.0f} s")
        try:
            kind, payload = pipe.recv()
        except EOFError:
            self.processes[rank].join(5)
            raise RuntimeError(f"rank {rank}'s process died (exit code {self.processes[rank].exitcode})") from None
        if kind == "error":
            name, message = payload
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, errors.TinyVLLMError):
                raise cls(message)
            raise RuntimeError(f"rank {rank}: {name}: {message}")
        return payload

    def _send(self, message) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch) -> PendingStep:
        self._send(("launch", (batch, sampling)))
        step = _Step()
        self._unanswered.append(step)
        return PendingStep(lambda: self._wait(step))

    def _wait(self, step: _Step) -> np.ndarray:
        while step.ids is None:
            oldest = self._unanswered.popleft()
            answers = [self._receive(rank) for rank in range(len(self.pipes))]
            oldest.ids, self.last_logprobs = answers[0]
        return step.ids

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        return self.launch(batch, sampling).wait()

    def _call(self, name: str, *args) -> list:
        """runner.name(*args) on every rank (after every step launched is answered)."""
        while self._unanswered:
            self._wait(self._unanswered[-1])
        self._send(("call", (name, args)))
        return [self._receive(rank) for rank in range(len(self.pipes))]

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        return self._call("prompt_logits", token_ids)[0]

    def memory_report(self) -> str:
        return "\n".join(f"rank {rank}:\n{report}" for rank, report in enumerate(self._call("memory_report")))

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            try:
                if process.is_alive():
                    pipe.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join(5)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.processes = [], []


class _Step:
    ids: np.ndarray | None = None


def rank_main(pipe, rank: int, device: str, config: ModelConfig, engine_config: EngineConfig,
              model_dir: Path, gguf_file: Path | None, unique_id: bytes | None) -> None:
    """A rank process: its GPU, its shards, its runner and communicator; then steps until closed."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    try:
        runner, communicator = _start_rank(rank, config, engine_config, model_dir, gguf_file, unique_id)
        pipe.send(("ready", dict(num_kv_blocks=runner.num_kv_blocks, overlaps_steps=runner.overlaps_steps,
                                 supports_logprobs=runner.supports_logprobs,
                                 supports_prompt_logprobs=runner.supports_prompt_logprobs)))
    except BaseException as e:  # noqa: BLE001 — sent to the engine process, which raises it
        pipe.send(("error", (type(e).__name__, str(e))))
        return
    try:
        _serve_steps(pipe, runner)
    except BaseException as e:  # noqa: BLE001
        try:
            pipe.send(("error", (type(e).__name__, str(e))))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if communicator is not None:
            from tinyvllm.parallel.cuda_rank import close_cuda_rank
            close_cuda_rank(runner)
            communicator.close()
        runner.close()


def _start_rank(rank, config, engine_config, model_dir, gguf_file, unique_id):
    from tinyvllm.checkpoint.loading import read_weights
    from tinyvllm.engine.startup import make_runner
    from tinyvllm.parallel.sharding import rank_config, rank_shards, rank_weights
    size = engine_config.tensor_parallel_size
    shards = rank_shards(config, size)
    weights = rank_weights(config, read_weights(model_dir, gguf_file, config, engine_config), shards[rank])
    if unique_id is not None and size > 1:      # cuda over several GPUs: gpu/tp_layer.py's forward
        from tinyvllm.parallel.cuda_rank import start_cuda_rank
        return start_cuda_rank(config, weights, engine_config, shards, rank, unique_id)
    shard = shards[rank]
    # the rank's own runner: the single-device backend at the rank's sizes
    runner = make_runner(rank_config(config, shard), weights,
                         dataclasses.replace(engine_config, tensor_parallel_size=None))
    communicator = None
    if unique_id is not None:
        from tinyvllm.gpu.nccl import NcclCommunicator
        with runner.device.active():
            communicator = NcclCommunicator(unique_id, size, rank)
        # the residual stream summed over the ranks on the step's stream (gpu/model.py's
        # sum_hidden_over_ranks), so the decode graphs are captured again with the all-reduces
        # in them (one rank: more start in parallel/cuda_rank.py)
        stream = runner.stream.handle
        runner.model.all_reduce = lambda ptr, count: communicator.all_reduce(ptr, ptr, count, "bfloat16", stream)
        if not engine_config.enforce_eager:
            runner.recapture_decode_graphs()
    return runner, communicator


def _serve_steps(pipe, runner: ModelRunner) -> None:
    """Launch each step as it comes; answer the oldest one when no message is waiting. A step
    with more than plain sampling waits for the ones before (its last_logprobs are its own)."""
    launched: deque[PendingStep] = deque()

    def answer_oldest():
        ids = launched.popleft().wait()
        pipe.send(("ids", (ids, runner.last_logprobs)))

    while True:
        if launched and not pipe.poll():
            answer_oldest()
            continue
        kind, payload = pipe.recv()
        if kind == "close":
            while launched:
                answer_oldest()
            return
        if kind == "call":
            while launched:
                answer_oldest()
            name, args = payload
            pipe.send(("result", getattr(runner, name)(*args)))
            continue
        batch, sampling = payload
        if not _plain(sampling):
            while launched:
                answer_oldest()
        launched.append(runner.launch(batch, sampling))


def _plain(sampling: SamplingBatch) -> bool:
    return sampling.edits is None and sampling.logprobs is None and sampling.token_mask is None
