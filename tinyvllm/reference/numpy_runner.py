"""NumpyRunner: the CPU backend (device="cpu") of the ModelRunner interface — the reference
model and the numpy twin of the GPU sampler over a float32 paged KV cache."""
from __future__ import annotations

import logging

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.quant.weight_kinds import is_quantized, quantization_summary
from tinyvllm.reference.model import ReferenceModel
from tinyvllm.reference.sampling import sample_step

NUMPY_KV_CACHE_BYTES = 256 << 20     # default KV cache of the CPU backend (float32)
log = logging.getLogger("tinyvllm.reference")


def numpy_kv_blocks(config: ModelConfig, engine_config: EngineConfig) -> int:
    """Explicit block count, else kv_cache_gb, else enough for max_num_seqs full contexts capped
    at NUMPY_KV_CACHE_BYTES — but never less than one full context, so that the default
    max_model_len is always servable (the engine refuses a cache that cannot hold one)."""
    if engine_config.num_kv_blocks is not None:
        return engine_config.num_kv_blocks
    block_bytes = engine_config.block_size * config.kv_bytes_per_token * 2   # float32, not bf16
    if engine_config.kv_cache_gb is not None:
        return max(1, int(engine_config.kv_cache_gb * 2**30) // block_bytes)
    one_context = engine_config.max_blocks_per_seq(config)
    wanted = engine_config.max_num_seqs * one_context
    return max(one_context, min(wanted, NUMPY_KV_CACHE_BYTES // block_bytes))


class NumpyRunner(ModelRunner):
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig):
        self.model = ReferenceModel(config, weights)
        self.num_kv_blocks = numpy_kv_blocks(config, engine_config)
        self.kv_cache = self.model.new_kv_cache(self.num_kv_blocks, engine_config.block_size)
        quantized = quantization_summary(weights)
        held = sum(w.nbytes if is_quantized(w) else 4 * w.size for w in weights.values())
        log.info("numpy backend (float32%s): weights %.1f MiB, KV cache %.1f MiB (%s blocks)",
                 f"; weights {quantized}, dequantized in each linear" if quantized else "",
                 held / 2**20, self.kv_cache.nbytes / 2**20, f"{self.num_kv_blocks:,}")

    supports_logprobs = True
    supports_prompt_logprobs = True

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        # sample_step keeps the raw logits of the rows that ask for logprobs (last_logprobs)
        # before it edits the rest in place
        ids, self.last_logprobs = sample_step(self.model.forward(batch, self.kv_cache), sampling)
        return ids

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """A dense recompute of the prompt without the cache (ReferenceModel.forward_full): the
        paged forward keeps only each sequence's last position."""
        return self.model.forward_full(np.asarray(token_ids, np.int32))

    def close(self) -> None:
        self.kv_cache = None


