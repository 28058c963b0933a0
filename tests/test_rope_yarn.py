"""YaRN RoPE scaling (tinyvllm/hf_config.py's YarnRopeScaling), as Qwen3's model cards give it for
long contexts: read in either transformers form, its attention factor inferred as transformers
infers it and folded into the softmax scale. tests/fixtures/families/qwen3_yarn holds the whole
forward pass to transformers (tests/test_golden_families.py)."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.config import EngineConfig, ModelConfig, YarnRopeScaling
from tinyvllm.errors import ModelLoadError, TinyVLLMError
from tinyvllm.rope import rope_inv_freq

FIXTURES = Path(__file__).parent / "fixtures" / "families"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _qwen3(**rope) -> dict:
    cfg = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    return {**{k: v for k, v in cfg.items() if k != "rope_parameters"}, **rope}


def test_both_forms_read_the_same():
    v4 = ModelConfig.from_dict(_qwen3(rope_theta=1e6, rope_scaling={"type": "yarn", **{k: v for k, v in YARN.items()
                                                                                       if k != "rope_type"}}))
    v5 = ModelConfig.from_dict(_qwen3(rope_parameters={**YARN, "rope_theta": 1e6}))
    assert v4 == v5 and v5.rope_scaling == YarnRopeScaling(4.0, 32768, 0.1 * math.log(4.0) + 1)


def test_attention_factor_is_transformers_and_scales_the_scores():
    """Given, inferred from factor, or from mscale / mscale_all_dim (DeepSeek's form); the scores
    are multiplied by its square (transformers: q and k each rotated by cos, sin times it)."""
    given = ModelConfig.from_dict(_qwen3(rope_parameters={**YARN, "attention_factor": 1.5}))
    assert given.attention_scale == pytest.approx(64 ** -0.5 * 1.5 ** 2)
    both = ModelConfig.from_dict(_qwen3(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}))
    assert both.rope_scaling.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.0707 * math.log(4) + 1))


def test_frequencies_are_transformers():
    """transformers 5.25's ROPE_INIT_FUNCTIONS["yarn"] on this config (theta 1e6, head_dim 64,
    factor 4, original 16): its first six frequencies, float32."""
    c = ModelConfig.from_dict(_qwen3(rope_parameters={**YARN, "rope_theta": 1e6, "original_max_position_embeddings": 16}))
    want = [1.0, 0.48703619837760925, 0.21084825694561005, 0.06846049427986145, 0.04445698484778404,
            0.028869550675153732]
    np.testing.assert_allclose(rope_inv_freq(c)[:6], want, rtol=2e-7)      # float64 here, float32 there


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "yarn", "factor": 4.0}, "of type yarn is missing 'original_max_position_embeddings'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 8}, "of type yarn is missing 'factor'"),
    ({**YARN, "truncate": "yes"}, "field 'rope_parameters.truncate' must be true or false"),
    ({**YARN, "beta_fast": -1}, "must be a positive number"),
    ({**YARN, "low_freq_factor": 1.0}, "field 'low_freq_factor' is not supported for rope type 'yarn'"),
])
def test_what_is_wrong_is_named(rope, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(_qwen3(rope_parameters=rope))


def test_yarn_on_gemma3_sliding_layers_is_refused():
    cfg = json.loads((FIXTURES / "gemma3" / "config.json").read_text())
    ropes = dict(cfg["rope_parameters"], sliding_attention={**YARN, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="yarn RoPE scaling on the sliding layers is not supported"):
        ModelConfig.from_dict({**cfg, "rope_parameters": ropes})


def test_the_context_is_the_stretched_one_and_no_longer():
    """With YaRN the model's context is its original length times the factor (Qwen3: 32,768 x 4),
    as vLLM derives it; a longer max_model_len is refused, never cut down in silence."""
    c = ModelConfig.from_dict(_qwen3(rope_parameters={**YARN, "rope_theta": 1e6}))
    assert c.max_context == 131_072 and EngineConfig().context_limit(c) == 131_072
    assert EngineConfig(max_model_len=4096).context_limit(c) == 4096
    plain = ModelConfig.from_dict(_qwen3())
    assert EngineConfig().context_limit(plain) == plain.max_position_embeddings
    with pytest.raises(TinyVLLMError, match=f"max_model_len={plain.max_position_embeddings + 1} is longer than"):
        EngineConfig(max_model_len=plain.max_position_embeddings + 1).context_limit(plain)
