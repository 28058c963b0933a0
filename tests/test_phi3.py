"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama forward pass with q/k/v and gate/up stored fused
(qkv_proj, gate_up_proj: tinyvllm/checkpoint/weight_names.py's STORED_FUSED) and a sliding window
on every layer where config.json sets one. tests/fixtures/families/phi3 holds the forward pass to
transformers (tests/test_golden_families.py); here the configs and the tensor names."""
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.checkpoint.weight_names import expected_shapes, fused_layer
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError

FIXTURE = Path(__file__).parent / "fixtures" / "families" / "phi3"
# a Phi-4-shaped config.json (transformers 4.x form)
PHI4 = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "bos_token_id": 100257, "embd_pdrop": 0.0,
    "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 100352}


def test_phi4_is_the_llama_forward_pass_with_fused_tensors():
    c = ModelConfig.from_dict(PHI4)
    assert (c.family, c.head_dim, c.rope_theta, c.sliding_window, c.tie_word_embeddings) == \
        ("phi3", 128, 250000.0, None, False)
    assert c.differences_from_llama() == []
    shapes = expected_shapes(c)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (5120 + 2 * 1280, 5120)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 17920, 5120)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes and "model.layers.0.mlp.up_proj.weight" not in shapes
    # Phi3Config: no window unless one is given (Phi-3-mini-4k gives 2047)
    mini = ModelConfig.from_dict({**PHI4, "sliding_window": 2047})
    assert mini.sliding_window == 2047 and set(mini.layer_types) == {"sliding_attention"}
    assert ModelConfig.from_dict({k: v for k, v in PHI4.items() if k != "sliding_window"}).sliding_window is None


@pytest.mark.parametrize("change, match", [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),       # Phi-4-mini
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "unsupported rope type 'longrope'"),                                                 # Phi-3.5 / Phi-4-mini
    ({"layer_types": ["sliding_attention"] * 40}, "layer_types is not read by Phi3ForCausalLM"),
])
def test_what_phi3_asks_and_is_not_computed_is_named(change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**PHI4, **change})


def test_the_stored_fused_tensors_are_the_engines_own():
    """The fixture's qkv_proj and gate_up_proj are used as they are: q, k, v rows in order and
    gate rows before up rows, the layout the engine fuses other families into."""
    config = ModelConfig.from_pretrained(FIXTURE)
    weights = load_weights(FIXTURE, config)
    stored = weights["model.layers.1.self_attn.qkv_proj.weight"]
    assert np.array_equal(fused_layer(weights, 1, "qkv", config).view(np.uint16), stored.view(np.uint16))
    assert fused_layer(weights, 1, "gate_up", config).shape == (2 * config.intermediate_size, config.hidden_size)
