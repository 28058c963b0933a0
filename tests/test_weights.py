"""Safetensors reading and writing: round trips, dtype conversion, tied embeddings, zero-copy
mapping, and a clear error for every way a checkpoint can be broken."""
import json
import mmap
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from tinyvllm.checkpoint.model_writer import random_tensor
from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.checkpoint.weights import BF16, INDEX_FILE, TensorSpec, load_weights, save_safetensors, save_sharded
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError


def small_config(tied=True) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128, "tie_word_embeddings": tied})


def random_weights(config, dtype=BF16) -> dict[str, np.ndarray]:
    return {n: random_tensor(TensorSpec(n, s, BF16), seed=1).astype(dtype)
            for n, s in expected_shapes(config).items()}


def assert_same(loaded, original):
    assert loaded.keys() == original.keys()
    for name, array in original.items():
        assert loaded[name].dtype == BF16, name
        np.testing.assert_array_equal(loaded[name].astype(np.float32),
                                      array.astype(BF16).astype(np.float32), err_msg=name)


def test_expected_shapes_names_and_tying():
    tied, untied = expected_shapes(small_config(True)), expected_shapes(small_config(False))
    assert "lm_head.weight" not in tied and untied["lm_head.weight"] == (64, 32)
    assert tied["model.layers.1.self_attn.k_proj.weight"] == (16, 32)
    assert tied["model.layers.0.self_attn.o_proj.weight"] == (32, 32)
    assert tied["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    assert len(tied) == 1 + 2 * 9 + 1


def test_single_file_round_trip(tmp_path):
    cfg = small_config()
    w = random_weights(cfg)
    save_safetensors(tmp_path / "model.safetensors", w)
    assert_same(load_weights(tmp_path, cfg), w)


def test_sharded_round_trip(tmp_path):
    cfg = small_config(tied=False)
    w = random_weights(cfg)
    files = save_sharded(tmp_path, w, max_shard_bytes=8000)
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(w)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in w.values())
    assert_same(load_weights(tmp_path, cfg), w)


def test_small_checkpoint_is_not_sharded(tmp_path):
    w = random_weights(small_config())
    assert [p.name for p in save_sharded(tmp_path, w, max_shard_bytes=1 << 30)] == ["model.safetensors"]
    assert not (tmp_path / INDEX_FILE).exists()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp16_and_fp32_are_converted_to_bf16(tmp_path, dtype):
    cfg = small_config()
    w = random_weights(cfg, dtype)
    save_safetensors(tmp_path / "model.safetensors", w)
    assert_same(load_weights(tmp_path, cfg), w)


def test_bf16_tensors_are_memory_mapped_not_copied(tmp_path):
    cfg = small_config()
    save_safetensors(tmp_path / "model.safetensors", random_weights(cfg))
    for name, array in load_weights(tmp_path, cfg).items():
        assert not array.flags.owndata and not array.flags.writeable, name
        base = array
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        assert isinstance(base, mmap.mmap), name


def test_tied_model_ignores_lm_head_and_extra_tensors(tmp_path):
    cfg = small_config(tied=True)
    w = random_weights(cfg)
    extra = {"lm_head.weight": np.ones((64, 32), BF16),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    save_safetensors(tmp_path / "model.safetensors", {**w, **extra})
    loaded = load_weights(tmp_path, cfg)
    assert "lm_head.weight" not in loaded
    assert_same(loaded, w)


def test_untied_model_without_lm_head_is_an_error(tmp_path):
    cfg = small_config(tied=False)
    w = random_weights(cfg)
    del w["lm_head.weight"]
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(ModelLoadError, match="no tensor 'lm_head.weight'"):
        load_weights(tmp_path, cfg)


def test_missing_tensor_is_named(tmp_path):
    cfg = small_config()
    w = random_weights(cfg)
    del w["model.layers.1.mlp.up_proj.weight"]
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, cfg)


def test_wrong_shape_names_tensor_file_and_both_shapes(tmp_path):
    cfg = small_config()
    w = random_weights(cfg)
    w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), BF16)
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model\.layers\.0\.self_attn"
                                             r"\.k_proj\.weight' has shape \(32, 32\), config.json implies \(16, 32\)"):
        load_weights(tmp_path, cfg)


def test_truncated_file_is_detected(tmp_path):
    cfg = small_config()
    path = tmp_path / "model.safetensors"
    save_safetensors(path, random_weights(cfg))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor .*truncated file"):
        load_weights(tmp_path, cfg)
    path.write_bytes(data[:5])
    with pytest.raises(ModelLoadError, match="truncated safetensors file"):
        load_weights(tmp_path, cfg)


def test_corrupt_header_is_detected(tmp_path):
    cfg = small_config()
    path = tmp_path / "model.safetensors"
    save_safetensors(path, random_weights(cfg))
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    data[10:14] = b"\xff\x00{]"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt safetensors header"):
        load_weights(tmp_path, cfg)
    path.write_bytes(struct.pack("<Q", 10**12) + bytes(data[8:]))
    with pytest.raises(ModelLoadError, match="header length"):
        load_weights(tmp_path, cfg)
    assert header_len > 0


def test_missing_shard_is_named(tmp_path):
    cfg = small_config()
    files = save_sharded(tmp_path, random_weights(cfg), max_shard_bytes=8000)
    files[1].unlink()
    with pytest.raises(ModelLoadError, match=f"shard {files[1].name} .* is missing"):
        load_weights(tmp_path, cfg)


def test_directory_without_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_weights(tmp_path, small_config())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        load_weights(tmp_path, small_config())
    with pytest.raises(ModelLoadError, match="not found"):
        load_weights(tmp_path / "absent", small_config())


def test_quantized_dtype_is_refused(tmp_path):
    cfg = small_config()
    w = random_weights(cfg)
    w["model.norm.weight"] = np.zeros(32, np.int8)
    save_safetensors(tmp_path / "model.safetensors", w)
    with pytest.raises(ModelLoadError, match="model.norm.weight.* dtype I8"):
        load_weights(tmp_path, cfg)


def test_our_files_load_with_the_safetensors_package(tmp_path):
    w = {"a": np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16),
         "b": np.linspace(-1, 1, 5).astype(np.float16), "c": np.arange(3, dtype=np.int64)}
    save_safetensors(tmp_path / "x.safetensors", w, metadata={"format": "pt"})
    theirs = safetensors.numpy.load_file(tmp_path / "x.safetensors")
    assert theirs.keys() == w.keys()
    for name in w:
        assert theirs[name].dtype == w[name].dtype
        np.testing.assert_array_equal(theirs[name], w[name])


def test_files_from_the_safetensors_package_load_with_ours(tmp_path):
    cfg = small_config()
    w = random_weights(cfg)
    safetensors.numpy.save_file(w, tmp_path / "model.safetensors")
    assert_same(load_weights(tmp_path, cfg), w)


def test_bf16_is_ml_dtypes_bfloat16():
    assert BF16 == np.dtype(ml_dtypes.bfloat16)


def write_raw(path, header, data: bytes = b"\0" * 64, header_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}, "do not match shape"),
    ({"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 64]}, "do not match shape"),
    ({"dtype": "F32", "shape": [-1, -16], "data_offsets": [0, 64]}, "malformed shape"),
    ({"dtype": "F32", "shape": [True, 16], "data_offsets": [0, 64]}, "malformed shape"),
    ({"dtype": "F32", "shape": "16", "data_offsets": [0, 64]}, "malformed shape"),
    ({"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}, "malformed shape"),
    ({"dtype": "F32", "shape": [16], "data_offsets": [0]}, "malformed data_offsets"),
    ({"dtype": "F32", "shape": [16], "data_offsets": [64, 0]}, "malformed data_offsets|do not match"),
    ({"dtype": "F32", "shape": [16], "data_offsets": [0.0, 64.0]}, "malformed data_offsets"),
    ({"dtype": ["F32"], "shape": [16], "data_offsets": [0, 64]}, "unsupported dtype"),
    ({"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]}, "truncated file"),
])
def test_crafted_header_entries_are_refused_before_any_allocation(tmp_path, entry, message):
    from tinyvllm.checkpoint.weights import SafetensorsFile
    path = write_raw(tmp_path / "model.safetensors", {"w": entry})
    with pytest.raises(ModelLoadError, match=f"tensor 'w': .*({message})"):
        SafetensorsFile.open(path)


def test_crafted_headers_are_refused(tmp_path):
    from tinyvllm.checkpoint.weights import MAX_HEADER_BYTES, SafetensorsFile
    path = tmp_path / "model.safetensors"
    with pytest.raises(ModelLoadError, match="nested too deeply"):
        SafetensorsFile.open(write_raw(path, b"[" * 200_000 + b"]" * 200_000))
    with pytest.raises(ModelLoadError, match="__metadata__ is not an object"):
        SafetensorsFile.open(write_raw(path, {"__metadata__": [1, 2]}))
    # a header length above the format's limit is refused before it is read (a sparse file)
    with open(write_raw(path, b"{}", data=b"", header_len=MAX_HEADER_BYTES + 1), "r+b") as f:
        f.truncate(MAX_HEADER_BYTES + 100)
    with pytest.raises(ModelLoadError, match="header length"):
        SafetensorsFile.open(path)
