"""The numpy twin of tensor parallelism: N ranks in one process.

Each rank is a ReferenceModel of its own sizes (parallel/sharding.py::rank_config) over its own
slices of the weights (rank_weights) and its own KV cache (its kv heads only). The ranks run the
very same forward (reference/model.py) side by side, one thread each, as the GPU ranks run one
process each; at every all-reduce (sharding.py's ALL_REDUCES) a rank waits for the others and
takes the sum of every rank's partial result, added in rank order (rank 0 + rank 1 + ...), so
every rank holds the same bits afterwards and the result does not depend on thread timing.
The GPU ranks (gpu/tp_layer.py) keep the reference forward's order: each o / down product summed
over the ranks first, then added into the residual, then the next norm (on the GPU the norm is
handed over after the sum, never from a partial product); the embedding's rows summed (one
non-zero term each, so scaling before or after the sum is the same); the LM head's slices
reduced to greedy keys, or gathered for the sampler.

ShardedNumpyRunner is the engine's CPU backend with EngineConfig.tensor_parallel_size > 1: greedy
steps reduce the vocabulary-parallel LM head to ids without gathering the logits; other steps
gather the logits and run the sampler (parallel/vocab_parallel.py).
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.parallel.sharding import RankShard, rank_config, rank_memory_lines, rank_shards, rank_weights
from tinyvllm.parallel.vocab_parallel import argmax_only, gather_vocab, ids_from_keys, shard_argmax_keys
from tinyvllm.reference.model import ReferenceModel
from tinyvllm.reference.numpy_runner import numpy_kv_blocks
from tinyvllm.reference.sampling import sample_step

log = logging.getLogger("tinyvllm.parallel")


class RankGroup:
    """An all-reduce among `size` threads: each posts its partial sum, waits for the others, and
    takes the sum in rank order."""

    def __init__(self, size: int):
        self.size = size
        self._posted: list[np.ndarray | None] = [None] * size
        self._barrier = threading.Barrier(size)

    def all_reduce(self, rank: int, x: np.ndarray) -> np.ndarray:
        self._posted[rank] = x
        self._barrier.wait()             # every rank has posted
        total = self._posted[0]
        for part in self._posted[1:]:
            total = total + part
        self._barrier.wait()             # every rank has read before anyone posts again
        return total

    def run(self, work) -> list:
        """work(rank) on every rank at once -> the results in rank order. A rank that raises
        breaks the barrier (the others stop at their next all-reduce) and its error is raised."""
        if self.size == 1:
            return [work(0)]
        results: list = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as e:  # noqa: BLE001 — handed to the caller below
                errors[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=one, args=(rank,), name=f"rank{rank}") for rank in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raised = [e for e in errors if e is not None]
        if raised:
            self._barrier.reset()
            raise next((e for e in raised if not isinstance(e, threading.BrokenBarrierError)), raised[0])
        return results


def rank_model(config: ModelConfig, weights: dict[str, np.ndarray], shard: RankShard, all_reduce) -> ReferenceModel:
    """Rank shard.rank's reference model: the config at the rank's sizes over its shards
    (weights: rank_weights'), its vocabulary slice's first id, `all_reduce` its sum over the ranks."""
    model = ReferenceModel(rank_config(config, shard), weights)
    model.vocab_start = shard.vocab.start
    model.all_reduce = all_reduce
    return model


class ShardedReferenceModel:
    """The reference forward over `size` ranks: rank_models[r] holds rank r's shards."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], size: int):
        self.config = config
        self.shards = rank_shards(config, size)
        self.group = RankGroup(size)
        self.rank_models = []
        for shard in self.shards:
            self.rank_models.append(rank_model(config, rank_weights(config, weights, shard), shard,
                                               lambda x, rank=shard.rank: self.group.all_reduce(rank, x)))

    def new_kv_caches(self, num_blocks: int, block_size: int) -> list[np.ndarray]:
        """One paged cache per rank, holding its kv heads only."""
        return [m.new_kv_cache(num_blocks, block_size) for m in self.rank_models]

    def forward(self, batch: ForwardBatch, kv_caches: list[np.ndarray]) -> list[np.ndarray]:
        """Every rank's logits shard [S, its vocab rows] of each sequence's last new token."""
        return self.group.run(lambda r: self.rank_models[r].forward(batch, kv_caches[r]))

    def forward_full(self, token_ids) -> np.ndarray:
        """Dense recompute without a cache, gathered: [T, V] logits of every token."""
        return gather_vocab(self.group.run(lambda r: self.rank_models[r].forward_full(token_ids)))

    def greedy_ids(self, shard_logits: list[np.ndarray]) -> np.ndarray:
        """int32 [S]: the argmax of each gathered row, from one key per row and rank."""
        return ids_from_keys([shard_argmax_keys(x, s.vocab.start) for x, s in zip(shard_logits, self.shards)])


class ShardedNumpyRunner(ModelRunner):
    """The CPU backend split over EngineConfig.tensor_parallel_size ranks."""
    supports_logprobs = True
    supports_prompt_logprobs = True

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig):
        self.config = config
        self.model = ShardedReferenceModel(config, weights, engine_config.tensor_parallel_size)
        self.num_kv_blocks = numpy_kv_blocks(config, engine_config)
        self.kv_caches = self.model.new_kv_caches(self.num_kv_blocks, engine_config.block_size)
        log.info("numpy backend over %d ranks (float32)\n%s", engine_config.tensor_parallel_size,
                 self.memory_report())

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        shard_logits = self.model.forward(batch, self.kv_caches)
        if argmax_only(sampling):
            self.last_logprobs = None
            return self.model.greedy_ids(shard_logits)
        ids, self.last_logprobs = sample_step(gather_vocab(shard_logits), sampling)
        return ids

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        return self.model.forward_full(np.asarray(token_ids, np.int32))

    def memory_report(self) -> str:
        """Each rank's share: its heads and rows, and the float32 weights and KV cache it holds."""
        held = [m.weight_bytes() for m in self.model.rank_models]
        lines = rank_memory_lines(self.config, len(held), weight_itemsize=4, kv_itemsize=4)
        lines += [f"  rank {r}: holds weights {w:,} bytes, KV cache {kv.nbytes:,} bytes ({self.num_kv_blocks:,} blocks)"
                  for r, (w, kv) in enumerate(zip(held, self.kv_caches))]
        return "\n".join(lines)

    def close(self) -> None:
        self.kv_caches = None
