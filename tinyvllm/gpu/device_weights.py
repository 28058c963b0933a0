"""Weights on the GPU: uploaded once, into one allocation, in the layout the forward pass wants.

The per-layer matrices are the fused ones of checkpoint/weight_names.py (q/k/v and gate/up
concatenated: two projections per layer where HF runs five). Tied checkpoints point the LM head
at the embedding table instead of uploading it twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint import weight_names as names
from tinyvllm.config import ModelConfig, rope_inv_freq
from tinyvllm.gpu.arena import round_up


@dataclass(frozen=True)
class LayerWeights:
    input_norm: int      # [hidden]
    qkv: int             # [q + 2 kv, hidden]
    o: int               # [hidden, q]
    post_norm: int       # [hidden]
    gate_up: int         # [2 inter, hidden]
    down: int            # [hidden, inter]


@dataclass(frozen=True)
class DeviceWeights:
    embed: int           # [vocab, hidden]
    final_norm: int      # [hidden]
    lm_head: int         # [vocab, hidden]; == embed when tied
    rope_inv_freq: int   # float32 [head_dim / 2]
    layers: tuple[LayerWeights, ...]
    nbytes: int
    allocation: object = field(repr=False, compare=False)   # the one device allocation behind them

    def free(self) -> None:
        self.allocation.free()


def device_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor uploaded, in upload order, with its (fused) shape."""
    h, i, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
    shapes = {"embed": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        shapes.update({f"{n}.input_norm": (h,), f"{n}.qkv": (qkv, h), f"{n}.o": (h, config.q_size),
                       f"{n}.post_norm": (h,), f"{n}.gate_up": (2 * i, h), f"{n}.down": (h, i)})
    shapes["final_norm"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, h)
    shapes["rope_inv_freq"] = (config.head_dim // 2,)
    return shapes


def device_tensor_itemsize(key: str) -> int:
    return 4 if key == "rope_inv_freq" else 2          # float32 frequencies, bf16 everything else


def device_weight_bytes(config: ModelConfig) -> int:
    """The size of the one weights allocation: every tensor, each start ALIGN-aligned."""
    return sum(round_up(int(np.prod(s)) * device_tensor_itemsize(k)) for k, s in device_tensor_shapes(config).items())


def _host_tensor(key: str, config: ModelConfig, w: dict[str, np.ndarray]) -> np.ndarray:
    """The host array for one device tensor (a device_tensor_shapes key)."""
    if key == "rope_inv_freq":
        return rope_inv_freq(config)             # float32: angles need the precision
    if key in ("embed", "final_norm"):
        return w[names.EMBED if key == "embed" else names.FINAL_NORM]
    if key == "lm_head":
        return names.lm_head(w, config)
    layer, part = key.split(".")
    return names.fused_layer(w, int(layer), part)


def upload_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> DeviceWeights:
    """Copy the model to the GPU in one allocation; DeviceWeights holds the pointers and owns
    the allocation (free() releases it)."""
    import pycuda.driver as drv

    shapes = device_tensor_shapes(config)
    total = device_weight_bytes(config)
    allocation = drv.mem_alloc(total)
    ptrs, offset = {}, int(allocation)
    for key, shape in shapes.items():
        arr = _host_tensor(key, config, weights)
        dtype = np.float32 if device_tensor_itemsize(key) == 4 else ml_dtypes.bfloat16
        arr = np.ascontiguousarray(arr, dtype=dtype)
        assert arr.shape == shape, (key, arr.shape, shape)
        drv.memcpy_htod(offset, arr)
        ptrs[key] = offset
        offset += round_up(arr.nbytes)
    layers = tuple(LayerWeights(**{f: ptrs[f"{n}.{f}"] for f in LayerWeights.__dataclass_fields__})
                   for n in range(config.num_hidden_layers))
    return DeviceWeights(embed=ptrs["embed"], final_norm=ptrs["final_norm"],
                         lm_head=ptrs.get("lm_head", ptrs["embed"]),
                         rope_inv_freq=ptrs["rope_inv_freq"], layers=layers, nbytes=total,
                         allocation=allocation)
