"""ModelConfig parsing: the fields we read from HF config.json and the errors for what we cannot serve."""
import json

import pytest

from tinyvllm.config import ModelConfig, RopeScaling
from tinyvllm.errors import ModelLoadError, TinyVLLMError
from tinyvllm.checkpoint.model_writer import PRESETS


def base(**changes):
    cfg = dict(PRESETS["llama-3.2-1b"])
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_llama_3_2_1b_config_is_read_exactly():
    c = ModelConfig.from_dict(base())
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (128256, 2048, 8192, 16)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 64)
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 500000.0 and c.max_position_embeddings == 131072
    assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert c.tie_word_embeddings and c.bos_token_id == 128000
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.q_size == 2048 and c.kv_size == 512
    assert c.kv_bytes_per_token == 16 * 2 * 512 * 2


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = base()
    del cfg["head_dim"]
    assert ModelConfig.from_dict(cfg).head_dim == 2048 // 32
    assert ModelConfig.from_dict(base(head_dim=128)).head_dim == 128


def test_kv_heads_default_to_query_heads():
    cfg = base()
    del cfg["num_key_value_heads"]
    assert ModelConfig.from_dict(cfg).num_key_value_heads == 32


@pytest.mark.parametrize("eos, expected", [(128001, (128001,)), ([128001, 128009], (128001, 128009)), (None, ())])
def test_eos_int_or_list(eos, expected):
    cfg = base()
    cfg["eos_token_id"] = eos
    assert ModelConfig.from_dict(cfg).eos_token_ids == expected


def test_rope_scaling_none_and_default_mean_plain_rope():
    assert ModelConfig.from_dict(base(rope_scaling=None)).rope_scaling is None
    cfg = base()
    cfg["rope_scaling"] = {"rope_type": "default"}
    assert ModelConfig.from_dict(cfg).rope_scaling is None


def test_rope_scaling_old_type_key_is_accepted():
    rs = dict(PRESETS["llama-3.2-1b"]["rope_scaling"])
    rs["type"] = rs.pop("rope_type")
    assert ModelConfig.from_dict(base(rope_scaling=rs)).rope_scaling.factor == 32.0


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_dict(base(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_llama3_rope_scaling_missing_field_is_named():
    rs = dict(PRESETS["llama-3.2-1b"]["rope_scaling"])
    del rs["low_freq_factor"]
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        ModelConfig.from_dict(base(rope_scaling=rs))


def test_non_llama_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="MistralForCausalLM"):
        ModelConfig.from_dict(base(architectures=["MistralForCausalLM"], model_type="mistral"))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_attention_heads",
                                   "intermediate_size", "num_hidden_layers", "rms_norm_eps"])
def test_missing_required_field_is_named(field):
    cfg = base()
    del cfg[field]
    with pytest.raises(ModelLoadError, match=f"missing required field '{field}'"):
        ModelConfig.from_dict(cfg)


def test_unsupported_features_are_refused():
    with pytest.raises(ModelLoadError, match="hidden_act"):
        ModelConfig.from_dict(base(hidden_act="gelu"))
    with pytest.raises(ModelLoadError, match="bias"):
        ModelConfig.from_dict(base(attention_bias=True))
    with pytest.raises(ModelLoadError, match="multiple"):
        ModelConfig.from_dict(base(num_key_value_heads=5))


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base()))
    assert ModelConfig.from_pretrained(tmp_path).hidden_size == 2048


def test_errors_are_user_errors():
    assert issubclass(ModelLoadError, TinyVLLMError)
