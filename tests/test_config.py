"""ModelConfig parsing: the fields we read from HF config.json in its transformers 4 and 5 forms,
and one clear error for everything we cannot serve or cannot read."""
import json

import pytest

from tinyvllm.checkpoint.model_writer import PRESETS
from tinyvllm.config import ModelConfig, RopeScaling
from tinyvllm.errors import ModelLoadError, TinyVLLMError


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


# config.json of meta-llama/Llama-3.2-1B-Instruct as transformers 4.45 wrote it, and the same
# model saved by transformers 5 (LlamaConfig(**v4).save_pretrained: rope_parameters, dtype).
LLAMA_3_2_1B_V4 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
LLAMA_3_2_1B_V5 = {
    **{k: v for k, v in LLAMA_3_2_1B_V4.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")},
    "dtype": "bfloat16", "pad_token_id": None, "transformers_version": "5.24.0",
    "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
                        "rope_type": "llama3"}}
# HuggingFaceTB/SmolLM2-135M-Instruct, both forms
SMOLLM2_V4 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
    "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152}
SMOLLM2_V5 = {
    **{k: v for k, v in SMOLLM2_V4.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")},
    "dtype": "bfloat16", "transformers_version": "5.24.0",
    "rope_parameters": {"rope_theta": 100000, "rope_type": "default"}}


@pytest.mark.parametrize("cfg", [LLAMA_3_2_1B_V4, LLAMA_3_2_1B_V5], ids=["v4", "v5"])
def test_real_llama_3_2_1b_config_both_forms(cfg):
    c = ModelConfig.from_dict(cfg)
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 32, 8)
    assert c.dtype == "bfloat16" and c.num_parameters == 1_235_814_400
    assert c == ModelConfig.from_dict(PRESETS["llama-3.2-1b"])


@pytest.mark.parametrize("cfg", [SMOLLM2_V4, SMOLLM2_V5], ids=["v4", "v5"])
def test_real_smollm2_135m_config_both_forms(cfg):
    c = ModelConfig.from_dict(cfg)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.dtype == "bfloat16"


def test_rope_scaling_none_and_default_mean_plain_rope():
    assert ModelConfig.from_dict(base(rope_scaling=None)).rope_scaling is None
    cfg = base()
    cfg["rope_scaling"] = {"rope_type": "default"}
    assert ModelConfig.from_dict(cfg).rope_scaling is None


def test_theta_defaults_to_transformers_llama_default():
    cfg = {k: v for k, v in SMOLLM2_V5.items() if k != "rope_parameters"}
    assert ModelConfig.from_dict(cfg).rope_theta == 10000.0
    assert ModelConfig.from_dict({**cfg, "rope_parameters": {"rope_type": "default"}}).rope_theta == 10000.0


def test_both_forms_together_must_agree():
    agree = {**LLAMA_3_2_1B_V5, "rope_theta": 500000.0, "rope_scaling": LLAMA_3_2_1B_V4["rope_scaling"],
             "torch_dtype": "bfloat16"}
    assert ModelConfig.from_dict(agree) == ModelConfig.from_dict(LLAMA_3_2_1B_V5)
    with pytest.raises(ModelLoadError,
                       match=r"conflicting rope_theta values \(rope_parameters: 500000, rope_theta: 10000\)"):
        ModelConfig.from_dict({**LLAMA_3_2_1B_V5, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="rope_scaling and rope_parameters disagree"):
        ModelConfig.from_dict({**LLAMA_3_2_1B_V5, "rope_scaling": {**LLAMA_3_2_1B_V4["rope_scaling"], "factor": 8.0}})
    with pytest.raises(ModelLoadError, match="rope_scaling and rope_parameters disagree"):
        ModelConfig.from_dict({**SMOLLM2_V5, "rope_scaling": LLAMA_3_2_1B_V4["rope_scaling"]})
    with pytest.raises(ModelLoadError, match="dtype='float16' and torch_dtype='bfloat16' disagree"):
        ModelConfig.from_dict({**SMOLLM2_V5, "dtype": "float16", "torch_dtype": "bfloat16"})


def test_rope_scaling_old_type_key_is_accepted():
    rs = dict(PRESETS["llama-3.2-1b"]["rope_scaling"])
    rs["type"] = rs.pop("rope_type")
    assert ModelConfig.from_dict(base(rope_scaling=rs)).rope_scaling.factor == 32.0


@pytest.mark.parametrize("kind, extra", [("dynamic", {"factor": 2.0}),
                                         ("longrope", {"short_factor": [1.0], "long_factor": [2.0]})])
@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_unimplemented_rope_types_are_named(kind, extra, form):
    with pytest.raises(ModelLoadError, match=f"unsupported rope type '{kind}' in {form}"):
        ModelConfig.from_dict({**SMOLLM2_V4, form: {"rope_type": kind, **extra}})


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5 is not supported"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25 is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5, "attention_factor": 1.0}},
     "rope_parameters field 'attention_factor' is not supported for rope type 'default'"),
    ({"rope_parameters": {**LLAMA_3_2_1B_V5["rope_parameters"], "beta_fast": 32}}, "'beta_fast' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "type": "yarn"}}, "rope_type and type"),
    ({"rope_parameters": {**LLAMA_3_2_1B_V5["rope_parameters"], "high_freq_factor": 1.0}},
     "high_freq_factor > low_freq_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e5"}},
     "field 'rope_parameters.rope_theta' must be a number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "must be a positive number"),
    ({"rope_parameters": [100000]}, "field 'rope_parameters' must be an object"),
    ({"rope_parameters": {"layer": {"rope_type": "default"}}}, "field 'layer' is not supported"),
])
def test_rope_fields_we_cannot_honour_are_named(change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**SMOLLM2_V5, **change})


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['GPTNeoXForCausalLM'\]"):
        ModelConfig.from_dict(base(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"))


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
    assert ModelConfig.from_dict(base(hidden_act="swish")).hidden_size == 2048   # the same SiLU
    with pytest.raises(ModelLoadError, match="attention_bias=true is not supported"):
        ModelConfig.from_dict(base(attention_bias=True))
    with pytest.raises(ModelLoadError, match="mlp_bias=true"):
        ModelConfig.from_dict(base(mlp_bias=True))
    with pytest.raises(ModelLoadError, match="multiple"):
        ModelConfig.from_dict(base(num_key_value_heads=5))
    with pytest.raises(ModelLoadError, match="quantization_config.quant_method = 'gptq'"):
        ModelConfig.from_dict(base(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(ModelLoadError, match="unsupported dtype 'float8_e4m3fn'"):
        ModelConfig.from_dict(base(torch_dtype="float8_e4m3fn"))
    # pretraining_tp only split the original matmuls into slices: same maths, served as is
    assert ModelConfig.from_dict(base(pretraining_tp=4)) == ModelConfig.from_dict(base())


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": "abc"}, "field 'hidden_size' must be an integer, got 'abc'"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' must be positive"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' must be positive"),
    ({"num_hidden_layers": 2.5}, "field 'num_hidden_layers' must be an integer"),
    ({"vocab_size": True}, "field 'vocab_size' must be an integer, got True"),
    ({"rms_norm_eps": 0}, "field 'rms_norm_eps' must be a positive number"),
    ({"eos_token_id": "</s>"}, "field 'eos_token_id' must be a token id or a list of them, got '</s>'"),
    ({"eos_token_id": [2, "x"]}, "field 'eos_token_id' must be a token id"),
    ({"bos_token_id": [1, 2]}, "field 'bos_token_id' must be a token id, got"),
    ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be true or false"),
    ({"head_dim": 63, "hidden_size": 567}, "head_dim=63 is odd"),
    ({"head_dim": None, "hidden_size": 577}, "hidden_size=577 is not a multiple of num_attention_heads=9"),
    ({"pretraining_tp": 0}, "field 'pretraining_tp' must be positive"),
])
def test_malformed_values_are_one_clear_error(change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**SMOLLM2_V5, **change})


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([SMOLLM2_V5]))
    with pytest.raises(ModelLoadError, match="must be a JSON object, got a list"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base()))
    assert ModelConfig.from_pretrained(tmp_path).hidden_size == 2048


def test_errors_are_user_errors():
    assert issubclass(ModelLoadError, TinyVLLMError)
