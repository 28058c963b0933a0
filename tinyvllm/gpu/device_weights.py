"""Weights on the GPU: uploaded once, into one allocation, in the layout the forward pass wants.

The per-layer matrices are the fused ones of checkpoint/weight_names.py (q/k/v and gate/up
concatenated: two projections per layer where HF runs five), and the parts a family adds
(weight_names.layer_parts: Qwen2's q/k/v biases, the q/k norms of Qwen3 and Gemma 3, Gemma 3's
norms around the MLP). Tied checkpoints point the LM head at the embedding table instead of
uploading it twice. RoPE's frequencies are one float32 table, two for a model whose sliding
layers have a RoPE of their own (Gemma 3).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint import weight_names as names
from tinyvllm.config import ModelConfig, rope_inv_freq
from tinyvllm.gpu.arena import round_up
from tinyvllm.hf_config import FULL, SLIDING


@dataclass(frozen=True)
class LayerWeights:
    input_norm: int      # [hidden]
    qkv: int             # [q + 2 kv, hidden]
    o: int               # [hidden, q]
    post_norm: int       # [hidden]
    gate_up: int         # [2 inter, hidden]
    down: int            # [hidden, inter]
    # a family's own parts (0: the model has none)
    qkv_bias: int = 0    # [q + 2 kv] (Qwen2)
    q_norm: int = 0      # [head_dim] (Qwen3, Gemma 3)
    k_norm: int = 0
    pre_mlp_norm: int = 0     # [hidden] (Gemma 3: pre_feedforward_layernorm)
    post_mlp_norm: int = 0    # [hidden] (Gemma 3: post_feedforward_layernorm)


@dataclass(frozen=True)
class DeviceWeights:
    embed: int           # [vocab, hidden]
    final_norm: int      # [hidden]
    lm_head: int         # [vocab, hidden]; == embed when tied
    rope_inv_freq: int   # float32 [head_dim / 2]
    layers: tuple[LayerWeights, ...]
    nbytes: int
    allocation: object = field(repr=False, compare=False)   # the one device allocation behind them
    sliding_rope_inv_freq: int = 0   # the sliding layers' own table (Gemma 3); 0: rope_inv_freq

    def inv_freq(self, layer_type: str) -> int:
        """The RoPE frequency table of the layers of `layer_type` (ModelConfig.layer_type)."""
        return self.sliding_rope_inv_freq if layer_type == SLIDING and self.sliding_rope_inv_freq else self.rope_inv_freq

    def free(self) -> None:
        self.allocation.free()

    @classmethod
    def at(cls, config: ModelConfig, ptrs: dict[str, int], nbytes: int, allocation) -> DeviceWeights:
        """The pointers of an upload (device_tensor_shapes' keys) as DeviceWeights."""
        layers = tuple(LayerWeights(**{part: ptrs[f"{n}.{part}"] for part in names.layer_parts(config)})
                       for n in range(config.num_hidden_layers))
        return cls(embed=ptrs["embed"], final_norm=ptrs["final_norm"], lm_head=ptrs.get("lm_head", ptrs["embed"]),
                   rope_inv_freq=ptrs["rope_inv_freq"], layers=layers, nbytes=nbytes, allocation=allocation,
                   sliding_rope_inv_freq=ptrs.get("sliding_rope_inv_freq", 0))


def device_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor uploaded, in upload order, with its (fused) shape."""
    h, i, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
    part_shapes = {"input_norm": (h,), "qkv": (qkv, h), "o": (h, config.q_size), "post_norm": (h,),
                   "gate_up": (2 * i, h), "down": (h, i), "qkv_bias": (qkv,), "q_norm": (config.head_dim,),
                   "k_norm": (config.head_dim,), "pre_mlp_norm": (h,), "post_mlp_norm": (h,)}
    shapes = {"embed": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        shapes.update({f"{n}.{part}": part_shapes[part] for part in names.layer_parts(config)})
    shapes["final_norm"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, h)
    shapes["rope_inv_freq"] = (config.head_dim // 2,)
    if config.sliding_rope_theta is not None and SLIDING in config.layer_types:
        shapes["sliding_rope_inv_freq"] = (config.head_dim // 2,)
    return shapes


def device_tensor_itemsize(key: str) -> int:
    return 4 if key.endswith("rope_inv_freq") else 2    # float32 frequencies, bf16 everything else


def device_weight_bytes(config: ModelConfig) -> int:
    """The size of the one weights allocation: every tensor, each start ALIGN-aligned."""
    return sum(round_up(int(np.prod(s)) * device_tensor_itemsize(k)) for k, s in device_tensor_shapes(config).items())


def _host_tensor(key: str, config: ModelConfig, w: dict[str, np.ndarray]) -> np.ndarray:
    """The host array for one device tensor (a device_tensor_shapes key)."""
    if key.endswith("rope_inv_freq"):           # float32: angles need the precision
        return rope_inv_freq(config, SLIDING if key == "sliding_rope_inv_freq" else FULL)
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
    return DeviceWeights.at(config, ptrs, total, allocation)
