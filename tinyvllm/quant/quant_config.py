"""config.json's `quantization_config` for FP8 checkpoints -> a frozen QuantConfig, or one
ModelLoadError naming the field tinyvllm cannot honour.

Two layouts declare FP8 (e4m3) weights:
  - quant_method "fp8" (vLLM's and AutoFP8's serialisation): {"activation_scheme": "dynamic",
    "ignored_layers": [...]}; each quantized linear has an F8_E4M3 `weight` and a float32
    `weight_scale` (per tensor; a per-channel [rows] or [rows, 1] scale is read too).
  - quant_method "compressed-tensors" (llm-compressor's FP8 and FP8_DYNAMIC schemes): one config
    group targeting "Linear" with weights {num_bits: 8, type: "float", strategy: "channel" or
    "tensor", symmetric, static}, and an `ignore` list.
Honoured: per-tensor and per-channel weight scales; the ignore list (exact module names, or
"re:PATTERN" matched from the start of the name with Python's re.match), whose linears stay bf16;
dynamic activation quantization, which the weight-only kernels replace by bf16 activations (the
more precise choice; vLLM does the same where FP8 tensor cores are missing). Refused: static
activation scales (input_scale tensors), block-wise scales (weight_block_size, block_structure),
group scales, KV-cache quantization, sparsity, and any field this module does not know.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tinyvllm.errors import ModelLoadError

# why a checkpoint's non-float tensor is refused when config.json declares no quantization
UNQUANTIZED = " (config.json declares no quantization_config)"

FP8_KEYS = {"quant_method", "activation_scheme", "ignored_layers", "modules_to_not_convert",
            "weight_block_size", "fmt", "is_checkpoint_fp8_serialized", "kv_cache_scheme"}
COMPRESSED_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme",
                   "sparsity_config", "quantization_status", "global_compression_ratio", "version",
                   "transform_config"}
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear weights are quantized.
    method: "fp8" (e4m3 codes with float32 scales; the only method so far).
    weight_strategy: "channel", "tensor", or None when each weight_scale's shape says.
    ignored: module names or "re:" patterns whose linears stay unquantized.
    origin: "fp8" or "compressed-tensors" (a checkpoint's layout) or "online" (a bf16
    checkpoint quantized at load, per channel)."""
    method: str
    weight_strategy: str | None
    ignored: tuple[str, ...]
    origin: str

    def quantizes(self, module: str) -> bool:
        """Is the linear layer `module` (e.g. "model.layers.0.mlp.down_proj") quantized?"""
        for entry in self.ignored:
            if entry.startswith("re:") and re.match(entry[3:], module):
                return False
            if entry == module:
                return False
        return True


def online_fp8(ignored: tuple[str, ...] = ("lm_head",)) -> QuantConfig:
    """--quantization fp8: quantize a bf16 checkpoint's linears at load, one scale per row."""
    return QuantConfig("fp8", "channel", tuple(ignored), "online")


def parse_quantization_config(config: dict, source: str) -> QuantConfig | None:
    """config.json (as a dict) -> its QuantConfig; None when it declares no quantization."""
    raw = config.get("quantization_config")
    if raw is None:
        return None

    def refuse(field: str, value, honoured: str):
        name = f"quantization_config.{field}" if field else "quantization_config"
        raise ModelLoadError(f"{source}: {name} = {value!r}: tinyvllm honours only {honoured}")

    if not isinstance(raw, dict):
        refuse("", raw, "an object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_fp8(raw, refuse)
    if method == "compressed-tensors":
        return _parse_compressed(raw, refuse)
    refuse("quant_method", method, "'fp8' and 'compressed-tensors' (FP8 e4m3 weights)")


def _unknown(raw: dict, known: set, refuse) -> None:
    for key in sorted(raw.keys() - known):
        if raw[key] not in (None, {}, [], ""):
            refuse(key, raw[key], f"the fields {', '.join(sorted(known))}")


def _names(value, field: str, refuse) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        refuse(field, value, "a list of module names")
    return tuple(value)


def _parse_fp8(raw: dict, refuse) -> QuantConfig:
    _unknown(raw, FP8_KEYS, refuse)
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        refuse("activation_scheme", raw["activation_scheme"], "'dynamic' (static input scales are not read)")
    if raw.get("weight_block_size") is not None:
        refuse("weight_block_size", raw["weight_block_size"], "null (per-tensor or per-channel scales)")
    if raw.get("fmt", "e4m3") != "e4m3":
        refuse("fmt", raw["fmt"], "'e4m3'")
    if raw.get("is_checkpoint_fp8_serialized", True) is not True:
        refuse("is_checkpoint_fp8_serialized", raw["is_checkpoint_fp8_serialized"], "true")
    if raw.get("kv_cache_scheme") is not None:
        refuse("kv_cache_scheme", raw["kv_cache_scheme"], "null (a bf16 KV cache)")
    ignored = _names(raw.get("ignored_layers"), "ignored_layers", refuse)
    ignored += _names(raw.get("modules_to_not_convert"), "modules_to_not_convert", refuse)
    return QuantConfig("fp8", None, ignored, "fp8")


def _parse_compressed(raw: dict, refuse) -> QuantConfig:
    _unknown(raw, COMPRESSED_KEYS, refuse)
    if raw.get("format") not in COMPRESSED_FORMATS:
        refuse("format", raw.get("format"), " or ".join(repr(f) for f in COMPRESSED_FORMATS))
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if raw.get(field) not in (None, {}):
            refuse(field, raw[field], "null")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        refuse("config_groups", groups, "exactly one config group")
    (group_name, group), = groups.items()
    at = f"config_groups.{group_name}"
    if not isinstance(group, dict):
        refuse(at, group, "an object")
    if group.get("targets") != ["Linear"]:
        refuse(f"{at}.targets", group.get("targets"), "['Linear']")
    if group.get("output_activations") is not None:
        refuse(f"{at}.output_activations", group["output_activations"], "null")
    strategy = _check_weights(group.get("weights"), f"{at}.weights", refuse)
    inputs = group.get("input_activations")
    if inputs is not None:
        if not isinstance(inputs, dict) or inputs.get("dynamic") is not True:
            refuse(f"{at}.input_activations", inputs, "null or dynamic quantization (bf16 activations are used)")
    ignored = _names(raw.get("ignore"), "ignore", refuse)
    return QuantConfig("fp8", strategy, ignored, "compressed-tensors")


def _check_weights(weights, at: str, refuse) -> str:
    """The weights scheme of the config group -> its strategy."""
    if not isinstance(weights, dict):
        refuse(at, weights, "an FP8 weights scheme")
    for field, value in {"num_bits": 8, "type": "float"}.items():
        if weights.get(field) != value:
            refuse(f"{at}.{field}", weights.get(field), repr(value))
    for field, value in {"symmetric": True, "dynamic": False}.items():
        if weights.get(field, value) != value:
            refuse(f"{at}.{field}", weights[field], repr(value))
    if weights.get("strategy") not in WEIGHT_STRATEGIES:
        refuse(f"{at}.strategy", weights.get("strategy"), " or ".join(repr(s) for s in WEIGHT_STRATEGIES))
    for field in ("group_size", "block_structure", "actorder"):
        if weights.get(field) not in (None, False):
            refuse(f"{at}.{field}", weights[field], "null")
    return weights["strategy"]
