"""A CUDA rank of a group of N > 1 (parallel/workers.py starts one per process): the rank's
CudaRunner at its own sizes, with the sampler's view of the full vocabulary, and its place in the
group (gpu/tp_layer.py's TensorParallelRank: the NCCL communicator and the LM head's gathered
slices), set on its model before the decode graphs are captured, so the graphs hold the
collectives. Every rank runs every step the engine sends, in the same order, so every rank
enqueues the same collectives in the same order (those of the sampler's gather included, though
only rank 0's ids are read).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.parallel.sharding import RankShard, rank_config


def start_cuda_rank(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig,
                    shards: list[RankShard], rank: int, unique_id: bytes):
    """-> (the rank's CudaRunner, its NcclCommunicator). weights: the rank's shards (rank_weights)."""
    from tinyvllm.engine.startup import check_cuda_support
    from tinyvllm.gpu.cuda_runner import CudaRunner
    from tinyvllm.gpu.nccl import NcclCommunicator
    from tinyvllm.gpu.tp_layer import TensorParallelRank
    local = rank_config(config, shards[rank])
    check_cuda_support(local)
    # eager first: the graphs are captured below, once the collectives are in the forward
    eager = dataclasses.replace(engine_config, tensor_parallel_size=None, enforce_eager=True)
    runner = CudaRunner(local, weights, eager, sampled_vocab=config.vocab_size)
    with runner.device.active():
        communicator = NcclCommunicator(unique_id, len(shards), rank)
        runner.model.tp = TensorParallelRank.new(communicator, rank, [s.vocab for s in shards], runner.dims.seqs,
                                                 runner.stream)
        if not engine_config.enforce_eager:
            runner.capture_decode_graphs()
    return runner, communicator


def close_cuda_rank(runner) -> None:
    """Before the communicator is destroyed: the graphs that hold its collectives, and the
    rank's gathered-logits buffers (the runner frees the rest after)."""
    tp = getattr(getattr(runner, "model", None), "tp", None)
    if tp is not None:
        with runner.device.active():
            runner.stream.synchronize()
            runner._close_graphs()
            tp.close()
