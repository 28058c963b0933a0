"""config.json of the families beside Llama (tinyvllm/model_family.py): the published configs in
their transformers 4 and 5 forms read exactly, transformers' defaults where a field is absent,
and one error naming the field for everything the engine does not honour."""
import dataclasses

import numpy as np
import pytest

from tinyvllm.config import LinearRopeScaling, ModelConfig, RopeScaling
from tinyvllm.errors import ModelLoadError
from tinyvllm.rope import rope_inv_freq

# config.json of Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B-Instruct, mistralai/Mistral-7B-Instruct-v0.3
# and google/gemma-3-1b-it as published (transformers 4.x)
QWEN3_V4 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN25_V4 = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_V4 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768}
GEMMA3_V4 = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
GEMMA3_LAYER_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]


def v5(cfg: dict, **fields) -> dict:
    """The same model as transformers 5.25 saves it (Config(**v4).save_pretrained): RoPE in
    rope_parameters, dtype, layer_types written out."""
    old = ("rope_theta", "rope_scaling", "rope_local_base_freq", "torch_dtype")
    return {**{k: v for k, v in cfg.items() if k not in old}, "dtype": "bfloat16",
            "transformers_version": "5.25.0", **fields}


QWEN3_V5 = v5(QWEN3_V4, rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, pad_token_id=None,
              layer_types=["full_attention"] * 28)
QWEN25_V5 = v5(QWEN25_V4, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
               sliding_window=None, layer_types=["full_attention"] * 24)
MISTRAL_V5 = v5(MISTRAL_V4, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, head_dim=128)
GEMMA3_V5 = v5(GEMMA3_V4, _sliding_window_pattern=6, layer_types=GEMMA3_LAYER_TYPES, use_bidirectional_attention=False,
               rope_parameters={"full_attention": {"rope_theta": 1000000, "rope_type": "default"},
                                "sliding_attention": {"rope_theta": 10000, "rope_type": "default"}})


@pytest.mark.parametrize("cfg", [QWEN3_V4, QWEN3_V5], ids=["v4", "v5"])
def test_qwen3_0_6b(cfg):
    c = ModelConfig.from_dict(cfg)
    assert c.family == "qwen3" and c.qk_norm and not c.qkv_bias and c.norm_weight_offset == 0
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_size, c.kv_size) == (1024, 16, 128, 2048, 1024)
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.tie_word_embeddings
    assert c.sliding_window is None and c.layer_types == () and c.differences_from_llama() == ["q/k norms"]
    assert c.attention_scale == 128 ** -0.5 and c.num_parameters == 596_049_920
    assert c == ModelConfig.from_dict(QWEN3_V4)


@pytest.mark.parametrize("cfg", [QWEN25_V4, QWEN25_V5], ids=["v4", "v5"])
def test_qwen2_5_0_5b(cfg):
    c = ModelConfig.from_dict(cfg)
    assert c.family == "qwen2" and c.qkv_bias and not c.qk_norm and c.head_dim == 64 and c.tie_word_embeddings
    assert c.sliding_window is None     # 32768 is written, but use_sliding_window is false
    assert c.num_parameters == 494_032_768 and c == ModelConfig.from_dict(QWEN25_V4)


@pytest.mark.parametrize("cfg", [MISTRAL_V4, MISTRAL_V5], ids=["v4", "v5"])
def test_mistral_7b_v0_3_is_the_llama_forward_pass(cfg):
    c = ModelConfig.from_dict(cfg)
    assert c.family == "mistral" and c.differences_from_llama() == [] and c.head_dim == 128
    assert c.num_parameters == 7_248_023_552 and c == ModelConfig.from_dict(MISTRAL_V4)


@pytest.mark.parametrize("cfg", [GEMMA3_V4, GEMMA3_V5], ids=["v4", "v5"])
def test_gemma_3_1b(cfg):
    c = ModelConfig.from_dict(cfg)
    assert c.family == "gemma3_text" and c.qk_norm and c.sandwich_norms and c.norm_weight_offset == 1.0
    assert c.hidden_act == "gelu_tanh" and c.embedding_scale == 1152 ** 0.5 and c.attention_scale == 256 ** -0.5
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106) and c.head_dim == 256
    assert c.sliding_window == 512 and list(c.layer_types) == GEMMA3_LAYER_TYPES
    assert [c.layer_window(i) for i in (4, 5, 6)] == [512, None, 512]
    assert (c.rope_theta, c.sliding_rope_theta, c.rope_scaling, c.sliding_rope_scaling) == (1e6, 1e4, None, None)
    assert c.num_parameters == 999_885_952 and c == ModelConfig.from_dict(GEMMA3_V4)
    assert rope_inv_freq(c, "sliding_attention")[1] == np.float32(10000 ** (-2 / 256))
    assert rope_inv_freq(c, "full_attention")[1] == np.float32(1e6 ** (-2 / 256))


def test_gemma3_linear_rope_on_full_layers_in_both_forms():
    """Gemma 3 4B's text model scales its full layers' RoPE linearly by 8 (rope_scaling in 4.x,
    rope_parameters.full_attention in 5.x); the sliding layers keep theirs."""
    old = {**GEMMA3_V4, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    new = {**GEMMA3_V5, "rope_parameters": {
        "full_attention": {"factor": 8.0, "rope_theta": 1000000, "rope_type": "linear"},
        "sliding_attention": {"rope_theta": 10000, "rope_type": "default"}}}
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert a == b and a.rope_scaling == LinearRopeScaling(8.0) and a.sliding_rope_scaling is None
    plain = ModelConfig.from_dict(GEMMA3_V4)
    np.testing.assert_array_equal(rope_inv_freq(a), (rope_inv_freq(plain).astype(np.float64) / 8).astype(np.float32))
    np.testing.assert_array_equal(rope_inv_freq(a, "sliding_attention"), rope_inv_freq(plain, "sliding_attention"))


def test_absent_fields_take_the_config_classes_defaults():
    qwen3 = ModelConfig.from_dict({k: v for k, v in QWEN3_V4.items() if k not in ("head_dim", "tie_word_embeddings")})
    assert qwen3.head_dim == 128 and not qwen3.tie_word_embeddings          # Qwen3Config's head_dim
    gemma = {k: v for k, v in GEMMA3_V4.items() if k not in (
        "head_dim", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern", "rope_theta",
        "rope_local_base_freq", "hidden_activation")}
    g = ModelConfig.from_dict(gemma)
    assert (g.head_dim, g.query_pre_attn_scalar, g.sliding_window) == (256, 256.0, 4096)
    assert (g.rope_theta, g.sliding_rope_theta, g.hidden_act) == (1e6, 1e4, "gelu_tanh")
    assert g.layer_types == tuple(GEMMA3_LAYER_TYPES) and g.tie_word_embeddings
    mistral = ModelConfig.from_dict({k: v for k, v in MISTRAL_V4.items() if k != "sliding_window"})
    assert mistral.sliding_window == 4096 and mistral.layer_types == ("sliding_attention",) * 32


def test_sliding_windows_of_mistral_v0_1_and_qwen():
    m = ModelConfig.from_dict({**MISTRAL_V4, "sliding_window": 4096})
    assert m.differences_from_llama() == ["sliding-window attention"] and m.layer_window(31) == 4096
    q = ModelConfig.from_dict({**QWEN25_V4, "use_sliding_window": True})
    assert [q.layer_window(i) for i in (20, 21, 23)] == [None, 32768, 32768]   # from max_window_layers on
    q5 = ModelConfig.from_dict({**QWEN25_V5, "use_sliding_window": True, "sliding_window": 32768,
                                "layer_types": ["full_attention"] * 21 + ["sliding_attention"] * 3})
    assert q5 == q


def test_family_is_model_type_else_architecture():
    assert ModelConfig.from_dict({k: v for k, v in QWEN3_V4.items() if k != "model_type"}).family == "qwen3"
    assert ModelConfig.from_dict({**GEMMA3_V4, "architectures": None}).family == "gemma3_text"
    with pytest.raises(ModelLoadError, match="model_type 'qwen2' and architectures .* name different model families"):
        ModelConfig.from_dict({**QWEN3_V4, "model_type": "qwen2"})
    # the multimodal wrapper is read as its language model (tests/test_multimodal_text.py) ...
    wrapped = ModelConfig.from_dict({"model_type": "gemma3", "text_config": GEMMA3_V4})
    assert wrapped == ModelConfig.from_dict(GEMMA3_V4)
    # ... another one is refused, naming what is served
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['LlavaForConditionalGeneration'\]; "
                                             r"tinyvllm serves .*Gemma3ForConditionalGeneration \(text only\)"):
        ModelConfig.from_dict({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"})


@pytest.mark.parametrize("cfg, change, match", [
    (GEMMA3_V4, {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    (GEMMA3_V4, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    (GEMMA3_V4, {"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    (GEMMA3_V4, {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    (GEMMA3_V4, {"attention_bias": True}, "attention_bias=true is not supported"),
    (GEMMA3_V4, {"sliding_window": None}, "names sliding_attention layers but there is no sliding_window"),
    (GEMMA3_V4, {"layer_types": ["full_attention"] * 25}, "field 'layer_types' must list 26 layer types"),
    (GEMMA3_V4, {"layer_types": ["chunked_attention"] * 26}, "field 'layer_types' must list 26"),
    (GEMMA3_V4, {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "unsupported rope type 'dynamic' in rope_scaling"),
    (GEMMA3_V4, {"rope_local_base_freq": -1}, "field 'rope_local_base_freq' must be a positive number"),
    (GEMMA3_V5, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "rope_parameters must be keyed by layer type .* field 'rope_theta' is not one"),
    (GEMMA3_V5, {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
     "unsupported rope type 'dynamic' in rope_parameters.full_attention"),
    (GEMMA3_V5, {"rope_theta": 5e5}, r"conflicting rope_theta values for full_attention layers \(rope_parameters: 1e\+06"),
    (GEMMA3_V5, {"rope_local_base_freq": 5e5}, "conflicting rope_theta values for sliding_attention layers"),
    (GEMMA3_V5, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     "rope_scaling and rope_parameters.full_attention disagree"),
    (QWEN3_V4, {"attention_bias": True}, "attention_bias=true is not supported"),
    (QWEN3_V4, {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    (QWEN3_V4, {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 28},
     "names sliding_attention layers but there is no sliding_window"),
    (QWEN25_V4, {"use_sliding_window": True, "sliding_window": 0}, "field 'sliding_window' must be positive"),
    (MISTRAL_V4, {"layer_types": ["sliding_attention"] * 32}, "layer_types is not read by MistralForCausalLM"),
    (MISTRAL_V4, {"sliding_window": "4k"}, "field 'sliding_window' must be an integer"),
    (MISTRAL_V4, {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "unsupported rope type 'longrope'"),
])
def test_what_is_not_honoured_is_named(cfg, change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**cfg, **change})


def test_fields_a_family_does_not_read_are_not_read():
    """As in transformers: MistralAttention has no biases whatever attention_bias says, and
    LlamaConfig has no sliding window."""
    assert ModelConfig.from_dict({**MISTRAL_V4, "attention_bias": True}) == ModelConfig.from_dict(MISTRAL_V4)
    llama = {**MISTRAL_V4, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "sliding_window": 4096}
    assert ModelConfig.from_dict(llama).sliding_window is None


def test_llama_config_defaults_are_llama():
    c = ModelConfig.from_dict({**MISTRAL_V4, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert c.family == "llama" and c.differences_from_llama() == [] and c.hidden_act == "silu"
    assert dataclasses.replace(c, family="mistral") == ModelConfig.from_dict(MISTRAL_V4)
    assert c.rope_scaling is None or isinstance(c.rope_scaling, RopeScaling)
