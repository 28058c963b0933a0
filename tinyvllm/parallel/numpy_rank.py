"""One rank of the numpy twin in a process of its own: the CPU model of the CUDA ranks'
plumbing (parallel/workers.py), so the CPU tests drive rank 0 in the engine process and the other
ranks in spawned processes with real collectives between them.

PipeGroup is the ranks' collective over pipes, a star through rank 0: every rank sends its part
to rank 0, which sends back the list of every rank's part in rank order; an all-reduce is that
list summed in rank order (rank 0 + rank 1 + ...), as parallel/numpy_ranks.py's threads sum it,
so the bits equal the threaded twin's. NumpyRank is ShardedNumpyRunner's step for one rank: its
shard's forward, then the greedy keys maxed over the ranks or the logits gathered for the sampler
(every rank samples the same gathered logits with the same seeds, so every rank holds the same
ids, which a step launched ahead is fed).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.parallel.numpy_ranks import rank_model
from tinyvllm.parallel.sharding import RankShard
from tinyvllm.parallel.vocab_parallel import argmax_only, gather_vocab, ids_from_keys, shard_argmax_keys
from tinyvllm.reference.numpy_runner import numpy_kv_blocks
from tinyvllm.reference.sampling import sample_step


class PipeGroup:
    """Rank `rank` of `size` numpy ranks' collectives. links: rank 0's pipes to ranks 1..N-1 in
    rank order, or another rank's one pipe to rank 0. lost(r) raises the error of rank r, whose
    pipe broke (its process failed or died)."""

    def __init__(self, rank: int, size: int, links: list, lost: Callable[[int], None]):
        self.rank, self.size, self.links, self.lost = rank, size, links, lost

    def gather(self, part: np.ndarray) -> list[np.ndarray]:
        """Every rank's part, in rank order, on every rank."""
        if self.size == 1:
            return [part]
        if self.rank > 0:
            self._send(self.links[0], part, 0)
            return self._receive(self.links[0], 0)
        parts = [part] + [self._receive(link, r) for r, link in enumerate(self.links, 1)]
        for r, link in enumerate(self.links, 1):
            self._send(link, parts, r)
        return parts

    def all_reduce(self, part: np.ndarray) -> np.ndarray:
        """The sum over the ranks, added in rank order: the same bits on every rank."""
        parts = self.gather(part)
        total = parts[0]
        for other in parts[1:]:
            total = total + other
        return total

    def _receive(self, link, rank: int):
        try:
            return link.recv()
        except (EOFError, OSError):
            self.lost(rank)
            raise

    def _send(self, link, message, rank: int) -> None:
        try:
            link.send(message)
        except (BrokenPipeError, OSError):
            self.lost(rank)
            raise


class NumpyRank(ModelRunner):
    """Rank shard.rank's runner: a ReferenceModel over its shards (weights: rank_weights'),
    its own KV cache (its kv heads), its collectives over `group`."""
    supports_logprobs = True
    supports_prompt_logprobs = True

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig,
                 shard: RankShard, group: PipeGroup):
        self.shard, self.group = shard, group
        self.model = rank_model(config, weights, shard, group.all_reduce)
        self.num_kv_blocks = numpy_kv_blocks(config, engine_config)
        self.kv_cache = self.model.new_kv_cache(self.num_kv_blocks, engine_config.block_size)

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        logits = self.model.forward(batch, self.kv_cache)
        if argmax_only(sampling):
            self.last_logprobs = None
            return ids_from_keys(self.group.gather(shard_argmax_keys(logits, self.shard.vocab.start)))
        ids, self.last_logprobs = sample_step(gather_vocab(self.group.gather(logits)), sampling)
        return ids

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        return gather_vocab(self.group.gather(self.model.forward_full(np.asarray(token_ids, np.int32))))

    def memory_report(self) -> str:
        return (f"numpy rank {self.shard.rank} of {self.shard.size}: weights {self.model.weight_bytes():,} bytes, "
                f"KV cache {self.kv_cache.nbytes:,} bytes ({self.num_kv_blocks:,} blocks)")

    def close(self) -> None:
        self.kv_cache = None
