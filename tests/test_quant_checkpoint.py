"""FP8 checkpoints: quantization_config parsing (tinyvllm/quant/quant_config.py), one error naming
each field that cannot be honoured, and F8_E4M3 safetensors files written by the safetensors
package itself read back and paired with their scales (tinyvllm/quant/fp8_checkpoint.py)."""
from __future__ import annotations

import copy
import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.fp8 import E4M3, quantize_per_channel
from tinyvllm.quant.fp8_checkpoint import fp8_linears, read_safetensors
from tinyvllm.quant.quant_config import QuantConfig, online_fp8, parse_quantization_config

BF16 = np.dtype(ml_dtypes.bfloat16)

# as llm-compressor's FP8_DYNAMIC scheme writes it into config.json
COMPRESSED = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "global_compression_ratio": 1.24, "ignore": ["lm_head", "re:.*mlp\\.down_proj$"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True, "group_size": None, "observer": None}}}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}


def parse(quantization_config):
    return parse_quantization_config({"quantization_config": quantization_config}, "m/config.json")


def test_no_quantization_config_is_none():
    assert parse_quantization_config({"hidden_size": 8}, "m") is None


def test_compressed_tensors_fp8_dynamic():
    config = parse(COMPRESSED)
    assert config == QuantConfig("fp8", "channel", ("lm_head", "re:.*mlp\\.down_proj$"), "compressed-tensors")
    assert config.quantizes("model.layers.0.self_attn.q_proj")
    assert not config.quantizes("lm_head") and not config.quantizes("model.layers.3.mlp.down_proj")
    assert config.quantizes("model.layers.3.mlp.down_proj_extra")


def test_fp8_method_and_online():
    assert parse(FP8) == QuantConfig("fp8", None, ("lm_head",), "fp8")
    assert online_fp8() == QuantConfig("fp8", "channel", ("lm_head",), "online")


def changed(base: dict, path: str, value) -> dict:
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


W = "config_groups.group_0.weights"
BAD = [
    (changed(FP8, "activation_scheme", "static"), "activation_scheme"),
    (changed(FP8, "weight_block_size", [128, 128]), "weight_block_size"),
    (changed(FP8, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
    (changed(FP8, "ignored_layers", "lm_head"), "ignored_layers"),
    (changed(FP8, "new_field", 1), "new_field"),
    (changed(FP8, "quant_method", "awq"), "quant_method"),
    (changed(COMPRESSED, f"{W}.strategy", "group"), f"{W}.strategy"),
    (changed(COMPRESSED, f"{W}.group_size", 128), f"{W}.group_size"),
    (changed(COMPRESSED, f"{W}.block_structure", "128x128"), f"{W}.block_structure"),
    (changed(COMPRESSED, f"{W}.num_bits", 4), f"{W}.num_bits"),
    (changed(COMPRESSED, f"{W}.type", "int"), f"{W}.type"),
    (changed(COMPRESSED, "config_groups.group_0.input_activations.dynamic", False),
     "config_groups.group_0.input_activations"),
    (changed(COMPRESSED, "config_groups.group_0.targets", ["re:.*q_proj"]), "config_groups.group_0.targets"),
    (changed(COMPRESSED, "kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (changed(COMPRESSED, "format", "pack-quantized"), "format"),
    (changed(COMPRESSED, "sparsity_config", {"format": "sparse-24"}), "sparsity_config"),
    ("fp8", ""),
]


@pytest.mark.parametrize("config,field", BAD, ids=[f or "not-an-object" for _, f in BAD])
def test_a_field_that_cannot_be_honoured_is_one_error_naming_it(config, field):
    name = f"quantization_config.{field}" if field else "quantization_config"
    with pytest.raises(ModelLoadError, match="^" + re.escape(f"m/config.json: {name} = ")):
        parse(config)


def two_linears(strategy: str):
    """q_proj per channel ([rows, 1] scale, as compressed-tensors writes it) or per tensor ([]),
    a bf16 norm, all written by the safetensors package."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 32)).astype(BF16)
    fp8 = quantize_per_channel(w)
    scale = fp8.scale.reshape(6, 1) if strategy == "channel" else np.array(fp8.scale.max(), np.float32)
    return {"model.layers.0.self_attn.q_proj.weight": fp8.codes,
            "model.layers.0.self_attn.q_proj.weight_scale": scale,
            "model.layers.0.input_layernorm.weight": np.ones(32, BF16)}


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_an_fp8_file_from_the_safetensors_package_reads_back(tmp_path, strategy):
    tensors = two_linears(strategy)
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    read, dtypes = read_safetensors(tmp_path / "model.safetensors")
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    out = fp8_linears(read, dtypes, QuantConfig("fp8", strategy, (), "compressed-tensors"), "m")
    assert set(out) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"}
    q = out["model.layers.0.self_attn.q_proj.weight"]
    assert q.codes.dtype == E4M3 and q.per_channel == (strategy == "channel")
    np.testing.assert_array_equal(q.codes.view(np.uint8), tensors["model.layers.0.self_attn.q_proj.weight"].view(np.uint8))
    np.testing.assert_array_equal(q.row_scales(), np.broadcast_to(tensors["model.layers.0.self_attn.q_proj.weight_scale"].reshape(-1), (6,)))
    np.testing.assert_array_equal(out["model.layers.0.input_layernorm.weight"], np.ones(32, BF16))


Q = "model.layers.0.self_attn.q_proj"


def broken(tensors: dict, change: str) -> dict:
    t = dict(tensors)
    if change == "no scale":
        del t[f"{Q}.weight_scale"]
    elif change == "no weight":
        t[f"{Q}.weight"] = t[f"{Q}.weight"].astype(np.float32).astype(BF16)
    elif change == "input scale":
        t[f"{Q}.input_scale"] = np.array(0.1, np.float32)
    elif change == "scale shape":
        t[f"{Q}.weight_scale"] = np.ones((3, 2), np.float32)
    elif change == "scale dtype":
        t[f"{Q}.weight_scale"] = np.ones((6, 1), np.int32)
    elif change == "non-finite scale":
        t[f"{Q}.weight_scale"] = np.full((6, 1), np.inf, np.float32)
    return t


CASES = [("no scale", f"{Q}.weight is F8_E4M3 but {Q}.weight_scale is missing", None),
         ("no weight", f"{Q}.weight_scale has no F8_E4M3 weight beside it", None),
         ("input scale", f"{Q}.input_scale: static activation scales", None),
         ("scale shape", r"weight_scale has shape \[3, 2\]; expected \[6\] or \[6, 1\]", "channel"),
         ("scale dtype", "weight_scale is I32", None),
         ("non-finite scale", "weight_scale holds a non-finite value", None),
         ("strategy", r"weight_scale has shape \[6, 1\]; expected \[\] or \[1\]", "tensor"),
         ("ignored", f"{Q}.weight is F8_E4M3 but quantization_config does not quantize it", None)]


@pytest.mark.parametrize("change,message,strategy", CASES, ids=[c for c, _, _ in CASES])
def test_a_broken_fp8_checkpoint_is_one_error_naming_the_tensor(tmp_path, change, message, strategy):
    safetensors.numpy.save_file(broken(two_linears("channel"), change), tmp_path / "m.safetensors")
    tensors, dtypes = read_safetensors(tmp_path / "m.safetensors")
    ignored = (Q,) if change == "ignored" else ()
    with pytest.raises(ModelLoadError, match=message):
        fp8_linears(tensors, dtypes, QuantConfig("fp8", strategy, ignored, "fp8"), "m")


def test_a_corrupt_or_truncated_file_is_a_model_load_error(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(two_linears("channel"), path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(ModelLoadError, match="data_offsets .* within the file's"):
        read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        read_safetensors(path)
    header = json.dumps({"x": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(ModelLoadError, match="unsupported or missing dtype 'F8_E5M2'"):
        read_safetensors(path)
