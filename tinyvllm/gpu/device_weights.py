"""Weights on the GPU: uploaded once, into one allocation, in the layout the forward pass wants.

The per-layer matrices are the fused ones of checkpoint/weight_names.py (q/k/v and gate/up
concatenated: two projections per layer where HF runs five), and the parts a family adds
(weight_names.layer_parts: Qwen2's q/k/v biases, the q/k norms of Qwen3 and Gemma 3, Gemma 3's
norms around the MLP). Tied checkpoints point the LM head at the embedding table instead of
uploading it twice. RoPE's frequencies are one float32 table, two for a model whose sliding
layers have a RoPE of their own (Gemma 3).

Quantized weights (FP8, GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K: gpu/quant_weights.py) are uploaded as
their two planes and held as QuantMatrix handles where a bf16 pointer would be; the GEMV launchers
read them with their kind's kernels (gpu/ops/quant_gemv.py). A fused group whose parts a GGUF file
stores in different formats (weight_kinds.RowStack: a Q4_K_M file's q/k/v with v in Q6_K) uploads
as one EXPANDED matrix (every part in one exact int8 + (a, b) form), not as separate parts: the
fused layer's qkv + RoPE + KV-write and gate_up + SwiGLU epilogues need the group's rows in one
GEMV, and one matrix keeps every path (fused, nine-launch, prefill) as it is for a uniform group,
at 12 bits a weight for that group. A quantized embedding table is uploaded twice: dequantized to
bf16 for the gather (which reads T rows a step, so its bytes cost memory, not time) and, when
tied, as its blocks for the LM head (which reads the whole table every step). Prefill's
quantized projections dequantize into `dequant_scratch` (bf16, the largest quantized layer
matrix) for cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint import weight_names as names
from tinyvllm.config import ModelConfig
from tinyvllm.gpu.arena import round_up
from tinyvllm.gpu.quant_weights import QuantMatrix, dequantized_table, pack_planes
from tinyvllm.hf_config import FULL, SLIDING
from tinyvllm.rope import rope_inv_freq


@dataclass(frozen=True)
class LayerWeights:
    input_norm: int      # [hidden]
    qkv: int | QuantMatrix       # [q + 2 kv, hidden]; a QuantMatrix when quantized
    o: int | QuantMatrix         # [hidden, q]
    post_norm: int       # [hidden]
    gate_up: int | QuantMatrix   # [2 inter, hidden]
    down: int | QuantMatrix      # [hidden, inter]
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
    lm_head: int | QuantMatrix   # [vocab, hidden]; == embed when tied (a quantized table: its planes)
    rope_inv_freq: int   # float32 [head_dim / 2]
    layers: tuple[LayerWeights, ...]
    nbytes: int
    allocation: object = field(repr=False, compare=False)   # the one device allocation behind them
    sliding_rope_inv_freq: int = 0   # the sliding layers' own table (Gemma 3); 0: rope_inv_freq
    nope_rope_inv_freq: int = 0      # zeros, for the layers without RoPE (SmolLM3)
    dequant_scratch: int = 0         # bf16 [dequant_scratch_elems]: prefill's dequantized weight
    dequant_scratch_elems: int = 0
    # the bytes a decode step streams: every tensor but a quantized embedding's bf16 gather table
    # (a step reads T rows of it) and the scratch: the bench's bandwidth floor divides by it
    streamed_bytes: int = 0

    @property
    def quantized(self) -> bool:
        """Whether any projection is a QuantMatrix (read by the quantized GEMVs, gpu/ops/quant_gemv.py)."""
        return any(isinstance(p, QuantMatrix) for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)) \
            or isinstance(self.lm_head, QuantMatrix)

    def inv_freq(self, config: ModelConfig, layer: int) -> int:
        """A layer's RoPE frequency table: its layer type's (ModelConfig.layer_type), or zeros on a
        layer without RoPE, whose rotation by angle 0 leaves q and k as they are, bit for bit
        (cos 0 = 1 and sin 0 = 0 exactly), so the kernels need no other path."""
        if layer in config.nope_layers:
            return self.nope_rope_inv_freq
        layer_type = config.layer_type(layer)
        return self.sliding_rope_inv_freq if layer_type == SLIDING and self.sliding_rope_inv_freq else self.rope_inv_freq

    def free(self) -> None:
        self.allocation.free()

    @classmethod
    def at(cls, config: ModelConfig, ptrs: dict, nbytes: int, allocation, scratch_elems: int = 0,
           streamed_bytes: int | None = None) -> DeviceWeights:
        """The pointers of an upload (device_tensor_shapes' keys) as DeviceWeights."""
        layers = tuple(LayerWeights(**{part: ptrs[f"{n}.{part}"] for part in names.layer_parts(config)})
                       for n in range(config.num_hidden_layers))
        return cls(embed=ptrs["embed"], final_norm=ptrs["final_norm"], lm_head=ptrs.get("lm_head", ptrs["embed"]),
                   rope_inv_freq=ptrs["rope_inv_freq"], layers=layers, nbytes=nbytes, allocation=allocation,
                   sliding_rope_inv_freq=ptrs.get("sliding_rope_inv_freq", 0),
                   nope_rope_inv_freq=ptrs.get("nope_rope_inv_freq", 0),
                   dequant_scratch=ptrs.get("dequant_scratch", 0), dequant_scratch_elems=scratch_elems,
                   streamed_bytes=nbytes if streamed_bytes is None else streamed_bytes)


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
    if config.nope_layers:
        shapes["nope_rope_inv_freq"] = (config.head_dim // 2,)
    return shapes


def device_tensor_itemsize(key: str) -> int:
    return 4 if key.endswith("rope_inv_freq") else 2    # float32 frequencies, bf16 everything else


def device_weight_bytes(config: ModelConfig, weights: dict | None = None) -> int:
    """The size of the one weights allocation: every tensor (with `weights`, quantized ones as
    their planes, and the dequantization scratch), each start ALIGN-aligned."""
    if weights is not None:
        return sum(t.nbytes for t in device_host_tensors(config, weights).values())
    return sum(round_up(int(np.prod(s)) * device_tensor_itemsize(k)) for k, s in device_tensor_shapes(config).items())


def _host_tensor(key: str, config: ModelConfig, w: dict):
    """The host weight for one device tensor (a device_tensor_shapes key): an array or a quantized kind."""
    if key == "nope_rope_inv_freq":
        return np.zeros(config.head_dim // 2, np.float32)
    if key.endswith("rope_inv_freq"):           # float32: angles need the precision
        return rope_inv_freq(config, SLIDING if key == "sliding_rope_inv_freq" else FULL)
    if key in ("embed", "final_norm"):
        return w[names.EMBED if key == "embed" else names.FINAL_NORM]
    if key == "lm_head":
        return names.lm_head(w, config)
    layer, part = key.split(".")
    return names.fused_layer(w, int(layer), part, config)


@dataclass(frozen=True, eq=False)
class HostTensor:
    """What one device tensor uploads: `arrays` (one float array, or a quantized matrix's
    (quants, scales) planes), its quantized `kind` and `shape` (None for a float tensor), or
    `reserve` bytes of scratch uploaded from nothing."""
    arrays: tuple[np.ndarray, ...]
    kind: str | None = None
    shape: tuple[int, int] | None = None
    reserve: int = 0

    @property
    def nbytes(self) -> int:
        """Device bytes, each part's start ALIGN-aligned."""
        return sum(round_up(a.nbytes) for a in self.arrays) + round_up(self.reserve)


def device_host_tensors(config: ModelConfig, weights: dict) -> dict[str, HostTensor]:
    """key -> what is uploaded for it, in upload order: float tensors as bf16 (float32 frequencies),
    quantized matrices as their planes, a quantized embedding as its bf16 table (plus "lm_head" as
    its planes when tied), and "dequant_scratch" when any layer matrix is quantized."""
    out, scratch = {}, 0
    keys = list(device_tensor_shapes(config))
    if not isinstance(weights[names.EMBED], np.ndarray) and config.tie_word_embeddings:
        keys.insert(keys.index("final_norm") + 1, "lm_head")     # the tied head reads the blocks
    for key in keys:
        host = _host_tensor(key, config, weights)
        if isinstance(host, np.ndarray):
            dtype = np.float32 if device_tensor_itemsize(key) == 4 else ml_dtypes.bfloat16
            out[key] = HostTensor((np.ascontiguousarray(host, dtype=dtype),))
        elif key == "embed":
            out[key] = HostTensor((dequantized_table(host),))
        else:
            kind, quants, scales = pack_planes(host)
            out[key] = HostTensor((quants, scales), kind, tuple(host.shape))
            if key != "lm_head":
                scratch = max(scratch, host.shape[0] * host.shape[1])
    if scratch:
        out["dequant_scratch"] = HostTensor((), reserve=2 * scratch)
    return out


def upload_weights(config: ModelConfig, weights: dict) -> DeviceWeights:
    """Copy the model to the GPU in one allocation; DeviceWeights holds the pointers (QuantMatrix
    handles for quantized matrices) and owns the allocation (free() releases it)."""
    import pycuda.driver as drv

    tensors, shapes = device_host_tensors(config, weights), device_tensor_shapes(config)
    total = sum(t.nbytes for t in tensors.values())
    allocation = drv.mem_alloc(total)
    ptrs, offset = {}, int(allocation)
    for key, tensor in tensors.items():
        starts = []
        for arr in tensor.arrays:
            drv.memcpy_htod(offset, arr)
            starts.append(offset)
            offset += round_up(arr.nbytes)
        if tensor.kind is not None:
            ptrs[key] = QuantMatrix(tensor.kind, *starts, *tensor.shape, nbytes=tensor.nbytes)
        elif tensor.reserve:
            ptrs[key] = offset
            offset += round_up(tensor.reserve)
        else:
            assert tensor.arrays[0].shape == shapes[key], (key, tensor.arrays[0].shape, shapes[key])
            ptrs[key] = starts[0]
    scratch = tensors["dequant_scratch"].reserve // 2 if "dequant_scratch" in tensors else 0
    return DeviceWeights.at(config, ptrs, total, allocation, scratch_elems=scratch,
                            streamed_bytes=streamed_weight_bytes(tensors, weights))


def streamed_weight_bytes(tensors: dict[str, HostTensor], weights: dict) -> int:
    """DeviceWeights.streamed_bytes of an upload plan (device_host_tensors)."""
    gather_only = "embed" if not isinstance(weights[names.EMBED], np.ndarray) else None
    return sum(t.nbytes for key, t in tensors.items() if key not in (gather_only, "dequant_scratch"))
