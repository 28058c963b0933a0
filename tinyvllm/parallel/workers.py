"""A tensor-parallel group as the engine's ModelRunner: rank 0 runs in the engine process, ranks
1..N-1 run one process each.

Rank 0's runner (its shards, KV cache and NCCL communicator) lives here, beside the scheduler and
the tokenizer, so its sampled ids are the step's result with no pipe in between: with rank 0 in a
process of its own, each step's round trip down a pipe and back cost the Llama-1B preset's batch-1
decode +9.7 % a token (bench --workload latency: 1.043 ms against the in-process 0.951 ms; H100,
2026-12-07, c1137ac). With N = 1 there is no process at all: the in-process runner with a
one-rank communicator, whose all-reduces the decode graphs capture. Each other rank's process
(multiprocessing spawn: a fresh interpreter, so a CUDA context of its own) sees only its own GPU
(CUDA_VISIBLE_DEVICES), reads the checkpoint itself, keeps its shards (parallel/sharding.py) and
runs its own runner (parallel/cuda_rank.py).

Start-up: rank 0 makes NCCL's unique id and hands it to every rank; every rank loads, then all
start NCCL together (ncclCommInitRank blocks until every rank has), rank 0 on a thread while the
engine watches the other processes, so a rank that fails or dies is its error here (a
TinyVLLMError raised again as itself), never a wait for ever; then every rank captures its decode
graphs. Each step goes down every other rank's pipe first, then rank 0 launches it here; the
collectives inside the forward keep the ranks in step. The other ranks answer nothing but calls:
one that fails sends its error and exits, and the engine raises it at its next step, call or
close (the CPU twin's collectives run over pipes, parallel/numpy_rank.py, so there at once). On
cuda a rank that dies inside a collective leaves the others waiting in NCCL, as in any NCCL group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
from collections import deque
from pathlib import Path

import numpy as np

from tinyvllm import errors
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner, PendingStep
from tinyvllm.parallel.sharding import rank_shards, rank_weights

START_TIMEOUT_S = 1800.0         # a rank reading, quantizing and uploading a large checkpoint
WATCH_INTERVAL_S = 0.2           # how often start-up looks at the other ranks while NCCL starts


def uses_rank_processes(engine_config: EngineConfig) -> bool:
    """cuda with an explicit tensor_parallel_size (1 included: the one-rank NCCL path)."""
    return engine_config.device == "cuda" and engine_config.tensor_parallel_size is not None


def rank_devices(size: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each rank: the r-th device this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(r) for r in range(size)]
    return devices[:size]


class RankProcesses(ModelRunner):
    """The ModelRunner of a tensor-parallel group: rank 0 here, one process per other rank."""
    takes_pending_token_masks = False    # a step goes to the other ranks whole, its mask already made

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, model_dir: Path, gguf_file: Path | None):
        size = engine_config.tensor_parallel_size
        cuda = engine_config.device == "cuda"
        unique_id = None
        if cuda:
            from tinyvllm.gpu.nccl import new_unique_id
            unique_id = new_unique_id()
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes, self.links = [], [], []
        self.local = self.communicator = None
        try:
            devices = rank_devices(size) if cuda else [None] * size
            for rank in range(1, size):
                ours, theirs = context.Pipe()
                link, their_link = context.Pipe() if not cuda else (None, None)
                process = context.Process(target=rank_main, name=f"tinyvllm-rank{rank}", daemon=True,
                                          args=(theirs, their_link, rank, devices[rank], config, engine_config,
                                                model_dir, gguf_file, unique_id))
                process.start()
                for end in filter(None, (theirs, their_link)):
                    end.close()
                self.pipes.append(ours)
                self.processes.append(process)
                if link is not None:
                    self.links.append(link)
            self.local = build_rank(0, config, engine_config, model_dir, gguf_file, self.links, self._raise_rank_error)
            for rank in range(1, size):
                self._receive(rank, START_TIMEOUT_S)                # loaded
            for pipe in self.pipes:
                pipe.send(("join", None))
            if cuda:
                self.communicator = self._connect(unique_id, size)
                from tinyvllm.parallel.cuda_rank import join_cuda_group
                join_cuda_group(self.local, self.communicator, engine_config, rank_shards(config, size), 0)
            ready = [self._receive(rank, START_TIMEOUT_S) for rank in range(1, size)]
        except BaseException:
            self.close()
            raise
        self.num_kv_blocks = min([self.local.num_kv_blocks] + ready)
        self.overlaps_steps = self.local.overlaps_steps
        self.supports_logprobs = self.local.supports_logprobs
        self.supports_prompt_logprobs = self.local.supports_prompt_logprobs

    last_logprobs = property(lambda self: self.local.last_logprobs)

    def _connect(self, unique_id: bytes, size: int):
        """Rank 0's communicator, started on a thread while the other ranks are watched: one that
        fails or dies raises its error here (the thread stays blocked in NCCL; the error ends the
        engine)."""
        from tinyvllm.parallel.cuda_rank import connect
        if size == 1:
            return connect(self.local, unique_id, 1, 0)
        made: list = []

        def start() -> None:
            try:
                made.append(connect(self.local, unique_id, size, 0))
            except BaseException as e:  # noqa: BLE001 — raised on the engine's thread below
                made.append(e)
        thread = threading.Thread(target=start, name="tinyvllm-nccl-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_INTERVAL_S)
            for rank, process in enumerate(self.processes, 1):
                if not process.is_alive():         # a failing rank sends its error, then exits
                    self._raise_rank_error(rank)
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def _raise_rank_error(self, rank: int) -> None:
        """Rank `rank` failed or died: raise its own error if it sent one."""
        pipe = self.pipes[rank - 1]
        if not pipe.poll():
            self.processes[rank - 1].join(5)
        if pipe.poll():
            self._receive(rank)
        raise RuntimeError(f"rank {rank}'s process stopped (exit code {self.processes[rank - 1].exitcode})")

    def _receive(self, rank: int, timeout: float | None = None):
        pipe = self.pipes[rank - 1]
        if timeout is not None and not pipe.poll(timeout):
            raise RuntimeError(f"rank {rank} did not answer in {timeout:.0f} s")
        try:
            kind, payload = pipe.recv()
        except (EOFError, OSError):
            self.processes[rank - 1].join(5)
            raise RuntimeError(f"rank {rank}'s process died (exit code {self.processes[rank - 1].exitcode})") from None
        if kind == "error":
            name, message = payload
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, errors.TinyVLLMError):
                raise cls(message)
            raise RuntimeError(f"rank {rank}: {name}: {message}")
        return payload

    def _send(self, message) -> None:
        """To every other rank, first raising the error any left (they send nothing else unasked)."""
        for rank, pipe in enumerate(self.pipes, 1):
            if pipe.poll():
                self._raise_rank_error(rank)
            try:
                pipe.send(message)
            except (BrokenPipeError, OSError):
                self._raise_rank_error(rank)

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch) -> PendingStep:
        if self.pipes:
            self._send(("launch", (batch, sampling)))
        return launch_now(self.local, batch, sampling)

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        return self.launch(batch, sampling).wait()

    def _call(self, name: str, *args) -> list:
        """runner.name(*args) on every rank -> the results in rank order."""
        self._send(("call", (name, args)))
        try:
            here = getattr(self.local, name)(*args)
        finally:        # every other rank's answer read, so none is left for the next step to find
            there = [self._receive(rank) for rank in range(1, len(self.pipes) + 1)]
        return [here] + there

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        return self._call("prompt_logits", token_ids)[0]

    def memory_report(self) -> str:
        return "\n".join(f"rank {rank}:\n{report}" for rank, report in enumerate(self._call("memory_report")))

    def close(self) -> None:
        """Rank 0's runner and communicator, then every other rank's process (whose collectives
        over pipes end as rank 0's links close)."""
        for pipe, process in zip(self.pipes, self.processes):
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(("close", None))
        for link in self.links:
            link.close()
        if self.local is not None:
            close_rank(self.local, self.communicator)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join(5)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.processes, self.links = [], [], []
        self.local = self.communicator = None


def launch_now(runner: ModelRunner, batch: ForwardBatch, sampling: SamplingBatch) -> PendingStep:
    """runner.launch(), its work done now where the runner does not overlap steps (the default
    launch waits to be waited for): every rank runs every step, in order, waited for or not."""
    pending = runner.launch(batch, sampling)
    if not runner.overlaps_steps:
        pending.wait()
    return pending


def build_rank(rank, config, engine_config, model_dir, gguf_file, links, lost) -> ModelRunner:
    """Rank `rank`'s runner over its own shards: cuda's eager CudaRunner (parallel/cuda_rank.py),
    or on the CPU the in-process numpy runner (one rank) or a NumpyRank over pipe `links`."""
    from tinyvllm.checkpoint.loading import read_weights
    from tinyvllm.engine.runners import make_runner
    size = engine_config.tensor_parallel_size
    shards = rank_shards(config, size)
    weights = read_weights(model_dir, gguf_file, config, engine_config)
    if engine_config.device == "cuda":
        from tinyvllm.parallel.cuda_rank import new_cuda_rank
        return new_cuda_rank(config, rank_weights(config, weights, shards[rank]) if size > 1 else weights,
                             engine_config, shards, rank)
    if size == 1:
        return make_runner(config, weights, dataclasses.replace(engine_config, tensor_parallel_size=None))
    from tinyvllm.parallel.numpy_rank import NumpyRank, PipeGroup
    group = PipeGroup(rank, size, links, lost)
    return NumpyRank(config, rank_weights(config, weights, shards[rank]), engine_config, shards[rank], group)


def close_rank(runner: ModelRunner, communicator) -> None:
    if communicator is not None:
        from tinyvllm.parallel.cuda_rank import close_cuda_rank
        close_cuda_rank(runner, communicator)
    else:
        runner.close()


def rank_main(pipe, link, rank: int, device: str | None, config: ModelConfig, engine_config: EngineConfig,
              model_dir: Path, gguf_file: Path | None, unique_id: bytes | None) -> None:
    """Rank `rank`'s process: its GPU, its shards, its runner and communicator; then steps until
    closed. Its errors go to the engine down `pipe`; it answers nothing else but calls."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    runner = communicator = None
    try:
        runner = build_rank(rank, config, engine_config, model_dir, gguf_file, [link], _rank_zero_gone)
        pipe.send(("loaded", None))
        if pipe.recv()[0] != "join":
            return
        if unique_id is not None:
            from tinyvllm.parallel.cuda_rank import connect, join_cuda_group
            size = engine_config.tensor_parallel_size
            communicator = connect(runner, unique_id, size, rank)
            join_cuda_group(runner, communicator, engine_config, rank_shards(config, size), rank)
        pipe.send(("ready", runner.num_kv_blocks))
        _serve_steps(pipe, runner)
    except BaseException as e:  # noqa: BLE001 — sent to the engine process, which raises it
        with contextlib.suppress(BrokenPipeError, OSError):
            pipe.send(("error", (type(e).__name__, str(e))))
    finally:
        if runner is not None:
            close_rank(runner, communicator)


def _rank_zero_gone(rank: int) -> None:
    raise RuntimeError("rank 0's pipe closed")


def _serve_steps(pipe, runner: ModelRunner) -> None:
    """Launch each step as it comes (at most one launched before it not yet waited for, as the
    engine launches); wait for the oldest when no message is waiting."""
    launched: deque[PendingStep] = deque()
    while True:
        if launched and not pipe.poll():
            launched.popleft().wait()
            continue
        kind, payload = pipe.recv()
        if kind in ("close", "call"):
            while launched:
                launched.popleft().wait()
        if kind == "close":
            return
        if kind == "call":
            name, args = payload
            pipe.send(("result", getattr(runner, name)(*args)))
            continue
        while len(launched) > 1:
            launched.popleft().wait()
        launched.append(launch_now(runner, *payload))
