"""The paged KV cache's device memory: one allocation of
[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim] bf16.

Per layer, K and V are each a [num_blocks * block_size, kv_heads, head_dim] array indexed by slot
(block * block_size + offset), the layout tinyvllm/engine/batch.py describes and the kernels read.
"""
from __future__ import annotations

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.errors import TinyVLLMError


def block_bytes(config: ModelConfig, block_size: int) -> int:
    return config.kv_bytes_per_token * block_size


def num_blocks_to_allocate(config: ModelConfig, engine: EngineConfig, free_bytes: int,
                           total_bytes: int) -> int:
    """Explicit block count, else explicit size in GB, else what fits in
    gpu_memory_utilization * total memory minus what is already in use."""
    per_block = block_bytes(config, engine.block_size)
    if engine.num_kv_blocks is not None:
        blocks = engine.num_kv_blocks
    elif engine.kv_cache_gb is not None:
        blocks = int(engine.kv_cache_gb * 2**30) // per_block
    else:
        in_use = total_bytes - free_bytes
        blocks = int(engine.gpu_memory_utilization * total_bytes - in_use) // per_block
    if blocks * per_block > free_bytes:
        raise TinyVLLMError(f"KV cache of {blocks} blocks needs {blocks * per_block / 2**30:.2f} GiB "
                            f"but only {free_bytes / 2**30:.2f} GiB of GPU memory is free")
    if blocks < 1:
        raise TinyVLLMError("no GPU memory left for the KV cache after the weights and activations; "
                            "lower --max-num-batched-tokens or raise --gpu-memory-utilization")
    return blocks


class DeviceKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int):
        import pycuda.driver as drv
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layer_stride = num_blocks * block_bytes(config, block_size) // config.num_hidden_layers
        self.nbytes = self.layer_stride * config.num_hidden_layers
        self._allocation = drv.mem_alloc(self.nbytes)
        self.base = int(self._allocation)

    def free(self) -> None:
        self._allocation.free()

    def k(self, layer: int) -> int:
        return self.base + layer * self.layer_stride

    def v(self, layer: int) -> int:
        return self.base + layer * self.layer_stride + self.layer_stride // 2
