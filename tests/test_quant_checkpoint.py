"""FP8 checkpoints: quantization_config parsing (tinyvllm/quant/quant_config.py), one error naming
each field that cannot be honoured; F8_E4M3 checkpoints written by the safetensors package itself
loaded by load_weights with each weight paired with its scale (tinyvllm/checkpoint/fp8_weights.py),
and every broken checkpoint one error naming the tensor; `--quantization fp8` at load."""
from __future__ import annotations

import copy
import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from tinyvllm.checkpoint.fp8_weights import linear_groups
from tinyvllm.checkpoint.weight_names import EMBED, fused_layer
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.fp8 import E4M3, Fp8Weight, quantize_per_channel
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


# ---- FP8 checkpoints on disk ------------------------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}


def channel_config() -> dict:
    return changed(COMPRESSED, "ignore", ["lm_head"])


def write_fp8_checkpoint(out, source_dir, quantization_config: dict, per_tensor: bool = False,
                         change=None):
    """The tiny preset model with every layer linear stored as e4m3 codes and a scale: per
    channel ([rows, 1], as compressed-tensors writes it) or per tensor (a scalar; q, k and v get
    different ones), written by the safetensors package; `change(tensors)` breaks it first."""
    config = ModelConfig.from_pretrained(source_dir)
    weights = load_weights(source_dir, config)
    tensors = dict(weights)
    for group in linear_groups(config):
        for name in group:
            w32 = weights[name].astype(np.float32)
            if per_tensor:
                scale = np.float32(np.abs(w32).max() / 448)
                tensors[name] = np.clip(w32 / scale, -448, 448).astype(E4M3)
                tensors[name[:-len(".weight")] + ".weight_scale"] = np.array(scale, np.float32)
            else:
                fp8 = quantize_per_channel(weights[name], name)
                tensors[name] = fp8.codes
                tensors[name[:-len(".weight")] + ".weight_scale"] = fp8.scale.reshape(-1, 1)
    if change is not None:
        change(tensors)
    out.mkdir()
    for f in source_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((source_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quantization_config)))
    safetensors.numpy.save_file(tensors, out / "model.safetensors")
    return out, tensors


@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_an_fp8_checkpoint_loads_with_scales_paired(tmp_path, tiny_model_dir, per_tensor):
    out, stored = write_fp8_checkpoint(tmp_path / "fp8", tiny_model_dir,
                                       PER_TENSOR if per_tensor else channel_config(), per_tensor)
    config = ModelConfig.from_pretrained(out)
    assert config.quantization.method == "fp8"
    weights = load_weights(out, config)
    for group in linear_groups(config):
        for name in group:
            w = weights[name]
            assert isinstance(w, Fp8Weight) and w.per_channel == (not per_tensor)
            np.testing.assert_array_equal(w.codes.view(np.uint8), stored[name].view(np.uint8))
            scale = stored[name[:-len(".weight")] + ".weight_scale"].reshape(-1)
            np.testing.assert_array_equal(w.row_scales(), np.broadcast_to(scale, (w.shape[0],)))
    assert weights[EMBED].dtype == BF16 and "lm_head.weight" not in weights     # tied: the bf16 embedding
    # the fused q/k/v: one scale per row, each part's scalar repeated over its rows
    qkv = fused_layer(weights, 0, "qkv", config)
    parts = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    np.testing.assert_array_equal(qkv.scale, np.concatenate([p.row_scales() for p in parts]))
    np.testing.assert_array_equal(qkv.codes.view(np.uint8), np.concatenate([p.codes for p in parts]).view(np.uint8))


def test_online_fp8_equals_the_same_codes_saved_as_a_checkpoint(tmp_path, tiny_model_dir):
    """--quantization fp8 on the bf16 model and an FP8 checkpoint holding quantize_per_channel's
    codes and scales load to the same weights, and the embedding, norms stay bf16."""
    out, _ = write_fp8_checkpoint(tmp_path / "fp8", tiny_model_dir, channel_config())
    saved = load_weights(out, ModelConfig.from_pretrained(out))
    config = ModelConfig.from_pretrained(tiny_model_dir)
    online = load_weights(tiny_model_dir, config, quantization="fp8")
    assert saved.keys() == online.keys()
    for name, w in online.items():
        if isinstance(w, Fp8Weight):
            np.testing.assert_array_equal(w.codes.view(np.uint8), saved[name].codes.view(np.uint8))
            np.testing.assert_array_equal(w.scale, saved[name].scale)
        else:
            assert w.dtype == BF16 and np.array_equal(w.view(np.uint16), saved[name].view(np.uint16)), name
    assert sum(isinstance(w, Fp8Weight) for w in online.values()) == 7 * config.num_hidden_layers


def drop(name):
    return lambda t: t.pop(name)


def bf16_weight(t):
    t[f"{Q}.weight"] = t[f"{Q}.weight"].astype(np.float32).astype(BF16)


def set_tensor(name, value):
    return lambda t: t.__setitem__(name, value)


BROKEN = [
    ("no scale", drop(f"{Q}.weight_scale"), None, f"{Q}.weight is F8_E4M3 but {Q}.weight_scale is missing"),
    ("no weight", bf16_weight, None, f"{Q}.weight_scale has no F8_E4M3 weight beside it"),
    ("input scale", set_tensor(f"{Q}.input_scale", np.array(0.1, np.float32)), None,
     f"{Q}.input_scale: static activation scales"),
    ("scale shape", set_tensor(f"{Q}.weight_scale", np.ones((3, 2), np.float32)), None,
     r"weight_scale has shape \[3, 2\]; expected \[256\] or \[256, 1\]"),
    ("scale dtype", set_tensor(f"{Q}.weight_scale", np.ones((256, 1), np.int32)), None,
     "weight_scale' has dtype I32; expected one of F32, BF16, F16"),
    ("non-finite scale", set_tensor(f"{Q}.weight_scale", np.full((256, 1), np.inf, np.float32)), None,
     "weight_scale holds a non-finite value"),
    ("strategy", None, changed(channel_config(), f"{W}.strategy", "tensor"),
     r"weight_scale has shape \[256, 1\]; expected \[\] or \[1\]"),
    ("ignored", None, changed(channel_config(), "ignore", ["lm_head", Q]),
     f"{Q}.weight is F8_E4M3 but quantization_config does not quantize it"),
    ("not stored as fp8", lambda t: (bf16_weight(t), t.pop(f"{Q}.weight_scale")), None,
     f"quantization_config quantizes {Q}, but its weight is stored as BF16"),
]


@pytest.mark.parametrize("name,change,config,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_fp8_checkpoint_is_one_error_naming_the_tensor(tmp_path, tiny_model_dir, name, change,
                                                                config, message):
    out, _ = write_fp8_checkpoint(tmp_path / "fp8", tiny_model_dir, config or channel_config(), change=change)
    with pytest.raises(ModelLoadError, match=message):
        load_weights(out, ModelConfig.from_pretrained(out))


def test_an_ignore_list_that_splits_a_fused_group_is_an_error(tmp_path, tiny_model_dir):
    """v_proj left in bf16 by the ignore list while q and k are FP8: the engine cannot run one
    fused q/k/v matrix of two kinds (vLLM refuses it the same way)."""
    v = "model.layers.1.self_attn.v_proj"

    def keep_v_bf16(t):
        t[f"{v}.weight"] = t[f"{v}.weight"].astype(np.float32).astype(BF16)
        t.pop(f"{v}.weight_scale")
    out, _ = write_fp8_checkpoint(tmp_path / "fp8", tiny_model_dir, changed(channel_config(), "ignore", ["lm_head", v]),
                                  change=keep_v_bf16)
    with pytest.raises(ModelLoadError, match=r"fuses self_attn.q_proj, self_attn.k_proj, self_attn.v_proj of "
                                             r"model.layers.1 into one matrix, but self_attn.q_proj, "
                                             r"self_attn.k_proj are FP8 and self_attn.v_proj is not"):
        load_weights(out, ModelConfig.from_pretrained(out))


def test_an_unknown_float8_dtype_is_refused(tmp_path):
    header = json.dumps({"x": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    from tinyvllm.checkpoint.weights import SafetensorsFile
    with pytest.raises(ModelLoadError, match="unsupported dtype 'F8_E5M2'"):
        SafetensorsFile.open(tmp_path / "model.safetensors")


def test_f8_weights_without_a_quantization_config_are_refused(tmp_path, tiny_model_dir):
    out, _ = write_fp8_checkpoint(tmp_path / "fp8", tiny_model_dir, channel_config())
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"has dtype F8_E4M3; expected one of BF16, F16, F32 \(config.json "
                                             r"declares no quantization_config\)"):
        load_weights(out, ModelConfig.from_pretrained(out))
