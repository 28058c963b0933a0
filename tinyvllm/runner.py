"""ModelRunner: the one interface between the scheduler and a backend. A runner owns the model
weights and the KV cache memory; each step it takes a ForwardBatch (tokens, positions, slots,
block tables) and a SamplingBatch and returns one sampled token id per sequence.

Backends: NumpyRunner (device="cpu": reference.py + the numpy sampling twin, slow but exact and
dependency-free) and tinyvllm.gpu.runner.CudaRunner (device="cuda")."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .batch import ForwardBatch
from .config import EngineConfig, ModelConfig
from .errors import GPUUnavailableError, TinyVLLMError
from .sampling import SamplingBatch, sample

NUMPY_KV_CACHE_BYTES = 256 << 20     # default KV cache of the CPU backend (float32)


class ModelRunner(ABC):
    num_kv_blocks: int               # KV cache size in blocks of EngineConfig.block_size tokens

    @abstractmethod
    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        """Run the batch's new tokens through the model (writing their K/V into the cache at
        batch.slot_mapping) and sample -> int32 [S]: the next token of each sequence."""

    def close(self) -> None:
        """Release the backend's memory. The runner is unusable afterwards."""


def numpy_kv_blocks(config: ModelConfig, engine_config: EngineConfig) -> int:
    """Explicit block count, else kv_cache_gb, else enough for max_num_seqs full contexts capped
    at NUMPY_KV_CACHE_BYTES."""
    if engine_config.num_kv_blocks is not None:
        return engine_config.num_kv_blocks
    block_bytes = engine_config.block_size * config.kv_bytes_per_token * 2   # float32, not bf16
    if engine_config.kv_cache_gb is not None:
        return max(1, int(engine_config.kv_cache_gb * 2**30) // block_bytes)
    wanted = engine_config.max_num_seqs * engine_config.max_blocks_per_seq(config)
    return max(1, min(wanted, NUMPY_KV_CACHE_BYTES // block_bytes))


class NumpyRunner(ModelRunner):
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig):
        from .reference import ReferenceModel
        self.model = ReferenceModel(config, weights)
        self.num_kv_blocks = numpy_kv_blocks(config, engine_config)
        self.kv_cache = self.model.new_kv_cache(self.num_kv_blocks, engine_config.block_size)

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> np.ndarray:
        return sample(self.model.forward(batch, self.kv_cache), sampling)

    def close(self) -> None:
        self.kv_cache = None


def make_runner(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig) -> ModelRunner:
    if engine_config.device == "cpu":
        return NumpyRunner(config, weights, engine_config)
    try:
        from .gpu.runner import CudaRunner
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
