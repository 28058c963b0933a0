"""A CUDA rank (parallel/workers.py starts rank 0 in the engine process, the others one per
process), in two stages, so that no rank enters NCCL's start-up (which blocks until every rank
has) before every rank has loaded:

  new_cuda_rank    the rank's CudaRunner, eager: over N > 1 ranks at its own sizes with the
                   sampler's view of the full vocabulary; over one rank the in-process runner
                   itself (make_runner: every checkpoint kind it serves)
  connect          its NcclCommunicator (with its GPU's context current)
  join_cuda_group  its place in the group set on its model before the decode graphs are
                   captured, so the graphs hold the collectives: over N > 1 ranks gpu/tp_layer.py's
                   TensorParallelRank (the communicator and the LM head's gathered slices); over
                   one rank the residual stream's sums (gpu/model.py's all_reduce) alone

Every rank runs every step the engine sends, in the same order, so every rank enqueues the same
collectives in the same order (those of the sampler's gather included, though only rank 0's ids
are read).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.parallel.sharding import RankShard, rank_config


def new_cuda_rank(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig,
                  shards: list[RankShard], rank: int):
    """-> the rank's CudaRunner, eager (its graphs are captured by join_cuda_group).
    weights: the rank's shards (rank_weights)."""
    from tinyvllm.engine.runners import check_cuda_support, make_runner
    from tinyvllm.gpu.cuda_runner import CudaRunner
    eager = dataclasses.replace(engine_config, tensor_parallel_size=None, enforce_eager=True)
    if len(shards) == 1:
        return make_runner(config, weights, eager)
    local = rank_config(config, shards[rank])
    check_cuda_support(local)
    return CudaRunner(local, weights, eager, sampled_vocab=config.vocab_size)


def connect(runner, unique_id: bytes, size: int, rank: int):
    """The rank's NcclCommunicator; blocks until every rank of the group has called it."""
    from tinyvllm.gpu.nccl import NcclCommunicator
    with runner.device.active():
        return NcclCommunicator(unique_id, size, rank)


def join_cuda_group(runner, communicator, engine_config: EngineConfig, shards: list[RankShard], rank: int) -> None:
    """The rank's collectives set on its model, then its decode graphs captured (unless
    enforce_eager): every rank at once, as the capture's warm-up steps run the collectives."""
    from tinyvllm.gpu.tp_layer import TensorParallelRank
    with runner.device.active():
        if len(shards) > 1:
            runner.model.tp = TensorParallelRank.new(communicator, rank, [s.vocab for s in shards],
                                                     runner.dims.seqs, runner.stream)
        else:      # the residual stream summed over the one rank on the step's stream
            stream = runner.stream.handle
            runner.model.all_reduce = lambda ptr, count: communicator.all_reduce(ptr, ptr, count, "bfloat16", stream)
        if not engine_config.enforce_eager:
            runner.capture_decode_graphs()


def close_cuda_rank(runner, communicator) -> None:
    """The graphs that hold the communicator's collectives and the rank's gathered-logits buffers
    first, then the communicator, then the rest of the runner."""
    tp = getattr(getattr(runner, "model", None), "tp", None)
    if getattr(runner, "blas", None) is not None:
        with runner.device.active():
            runner.stream.synchronize()
            runner._close_graphs()
            if tp is not None:
                tp.close()
    if communicator is not None:
        communicator.close()
    runner.close()
