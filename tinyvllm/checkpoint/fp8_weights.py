"""FP8 weights at load: a checkpoint saved in FP8 read directly, or a bf16 checkpoint quantized
per output channel (`--quantization fp8`, EngineConfig.quantization).

What an FP8 checkpoint stores for a quantized linear layer M (vLLM's "fp8" serialisation and
compressed-tensors' float-quantized format alike; config.json's quantization_config says which
linears, tinyvllm/quant/quant_config.py):
    M.weight        F8_E4M3  [rows, cols]    one e4m3 code per weight (quant/fp8.py's layout)
    M.weight_scale  F32 (or BF16 / F16)      [] or [1]: per tensor;  [rows] or [rows, 1]: per channel
    M.input_scale   present only with static activation scales, which are refused
W[r, c] ~ weight[r, c] * scale[r] (or the one scale). Other tensors (embedding, norms, ignored
linears) are ordinary float tensors, loaded as bf16. The files are read by
weights.py's one safetensors reader (F8_E4M3 is in its dtype table).

The engine fuses q/k/v and gate/up into one matrix each (weight_names.py); a fused
group is FP8 in all its parts or in none (an ignore list that splits a group is an error, as in
vLLM), and per-tensor scales of a group become per-channel rows when the parts are stacked
(tinyvllm/quant/weight_kinds.py::concat_rows). lm_head is quantized only when the checkpoint
stores it in FP8; `--quantization fp8` leaves it and the embedding in bf16, as vLLM's dynamic
FP8 does.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.checkpoint.weight_names import LM_HEAD, expected_shapes, layer_prefix, part_names
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.fp8 import E4M3, Fp8Weight, quantize_per_channel
from tinyvllm.quant.quant_config import UNQUANTIZED, QuantConfig, online_fp8

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
WEIGHT, SCALE, INPUT_SCALE = ".weight", ".weight_scale", ".input_scale"
LINEAR_PARTS = ("qkv", "o", "gate_up", "down")
QUANTIZATION_METHODS = ("fp8",)


def linear_groups(config: ModelConfig) -> list[tuple[str, ...]]:
    """The layer linears' weight names, grouped as the engine fuses them (q/k/v, o, gate/up, down)."""
    return [tuple(layer_prefix(layer) + name for name in part_names(config, part))
            for layer in range(config.num_hidden_layers) for part in LINEAR_PARTS]


def fp8_weight(codes: np.ndarray, scale: np.ndarray, name: str, strategy: str | None,
               source: str) -> Fp8Weight:
    """One checkpoint weight (e4m3 [rows, cols]) and its weight_scale -> Fp8Weight. The scale's
    shape says per tensor ([] or [1]) or per channel ([rows] or [rows, 1]); `strategy` ("tensor",
    "channel", None: either) is what quantization_config declared."""
    if codes.dtype != E4M3 or codes.ndim != 2:
        raise ModelLoadError(f"{source}: {name}{WEIGHT} is {codes.dtype}{list(codes.shape)}; "
                             "a quantized linear's weight is a float8_e4m3fn matrix")
    rows = codes.shape[0]
    found = "tensor" if scale.size == 1 and scale.ndim <= 1 else \
        "channel" if scale.shape in ((rows,), (rows, 1)) else None
    if found is None or (strategy is not None and found != strategy):
        expected = {"tensor": "[] or [1]", "channel": f"[{rows}] or [{rows}, 1]",
                    None: f"[], [1], [{rows}] or [{rows}, 1]"}[strategy]
        raise ModelLoadError(f"{source}: {name}{SCALE} has shape {list(scale.shape)}; expected "
                             f"{expected} for a {rows}-row weight")
    scale32 = scale.astype(np.float32)
    if not np.isfinite(scale32).all():
        raise ModelLoadError(f"{source}: {name}{SCALE} holds a non-finite value")
    return Fp8Weight(codes, scale32.reshape(() if found == "tensor" else (rows,)))


def load_fp8_weights(reader, config: ModelConfig,
                     quantization: str | None) -> dict[str, np.ndarray | Fp8Weight]:
    """reader: checkpoint/weights.py's CheckpointReader (passed in: that module imports this one).
    The model's tensors with its quantized linears as Fp8Weight: read from an FP8 checkpoint
    (config.quantization set), or quantized here from bf16 (`quantization` "fp8")."""
    source = str(reader.model_dir)
    declared = config.quantization
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization {quantization!r} is not supported (only 'fp8')")
    if declared is None:
        weights = {name: reader.get_bf16(name, shape, why=UNQUANTIZED)
                   for name, shape in expected_shapes(config).items()}
        return quantize_linears(weights, config, online_fp8())
    if quantization is not None and quantization != declared.method:
        raise ModelLoadError(f"{source}: --quantization {quantization} contradicts the checkpoint's "
                             f"quantization_config ({declared.origin}: {declared.method} weights)")
    for name in reader.where:
        if name.endswith(INPUT_SCALE):
            raise ModelLoadError(f"{source}: {name}: static activation scales are not supported "
                                 "(quantize the activations dynamically)")
    layer_linears = {name for group in linear_groups(config) for name in group}
    weights: dict[str, np.ndarray | Fp8Weight] = {}
    for name, shape in expected_shapes(config).items():
        module = name[:-len(WEIGHT)]
        if reader.entry(name)[1]["dtype"] == FP8_DTYPE:
            if (name not in layer_linears and name != LM_HEAD) or not declared.quantizes(module):
                raise ModelLoadError(f"{source}: {name} is F8_E4M3 but quantization_config does "
                                     "not quantize it")
            if module + SCALE not in reader.where:
                raise ModelLoadError(f"{source}: {name} is F8_E4M3 but {module}{SCALE} is missing")
            scale = reader.get(module + SCALE, dtypes=SCALE_DTYPES)
            weights[name] = fp8_weight(reader.get(name, shape, (FP8_DTYPE,)), scale, module,
                                       declared.weight_strategy, source)
            continue
        if module + SCALE in reader.where:
            raise ModelLoadError(f"{source}: {module}{SCALE} has no F8_E4M3 weight beside it")
        if name in layer_linears and declared.quantizes(module):
            raise ModelLoadError(f"{source}: quantization_config quantizes {module}, but its weight "
                                 f"is stored as {reader.entry(name)[1]['dtype']}, not F8_E4M3")
        weights[name] = reader.get_bf16(name, shape)
    check_fused_groups(weights, config, source)
    return weights


def quantize_linears(weights: dict[str, np.ndarray], config: ModelConfig,
                     qconfig: QuantConfig) -> dict[str, np.ndarray | Fp8Weight]:
    """Every layer linear that `qconfig` quantizes -> Fp8Weight, one scale per output row
    (quant/fp8.py::quantize_per_channel); the embedding, norms and lm_head stay as they are."""
    out: dict[str, np.ndarray | Fp8Weight] = dict(weights)
    for group in linear_groups(config):
        for name in group:
            if qconfig.quantizes(name[:-len(WEIGHT)]):
                out[name] = quantize_per_channel(weights[name], name)
    check_fused_groups(out, config, "--quantization fp8")
    return out


def check_fused_groups(weights: dict, config: ModelConfig, source: str) -> None:
    """A fused group (q/k/v, gate/up) must be FP8 in all its parts or in none."""
    for group in linear_groups(config):
        kinds = {isinstance(weights[name], Fp8Weight) for name in group}
        if len(kinds) > 1:
            prefix = group[0][:group[0].index(".self_attn.") if ".self_attn." in group[0] else group[0].index(".mlp.")]
            short = {name: name[len(prefix) + 1:-len(WEIGHT)] for name in group}
            fp8 = [short[name] for name in group if isinstance(weights[name], Fp8Weight)]
            rest = [short[name] for name in group if short[name] not in fp8]
            raise ModelLoadError(f"{source}: the engine fuses {', '.join(short.values())} of {prefix} into one "
                                 f"matrix, but {', '.join(fp8)} {'is' if len(fp8) == 1 else 'are'} FP8 and "
                                 f"{', '.join(rest)} {'is' if len(rest) == 1 else 'are'} not (an ignore list "
                                 "must keep or drop a fused group whole)")
