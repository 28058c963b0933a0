"""SmolLM3: layers without RoPE (SmolLM3Attention.use_rope = no_rope_layers[layer], 1 meaning RoPE).
config.json read as transformers 5.25's SmolLM3Config reads it (tinyvllm/model_family.py), the numpy
twin skipping the rotation on those layers (tests/test_golden_families.py holds the fixture
tests/fixtures/families/smollm3 to transformers), and the CUDA launchers giving those layers the
zero frequency table (a rotation by angle 0: q and k unchanged, bit for bit), checked here on the
CPU over tests/test_family_launches.py's checked fake runner."""
from pathlib import Path

import pytest

from tinyvllm.config import ModelConfig
from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.errors import ModelLoadError
from tinyvllm.gpu.step_shape import StepShape

FIXTURE = Path(__file__).parent / "fixtures" / "families" / "smollm3"
# a SmolLM3-3B-shaped config.json (transformers 4.x form, no_rope_layers left to its interval)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11008, "max_position_embeddings": 65536, "mlp_bias": False, "model_type": "smollm3",
    "no_rope_layer_interval": 4, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 5000000.0, "sliding_window": None, "use_sliding_window": False,
    "eos_token_id": 128012, "pad_token_id": 128004, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def test_smollm3_reads_as_transformers_reads_it():
    """transformers 5.25's SmolLM3Config(**SMOLLM3_3B): no RoPE on layers 3, 7, ..., 35, theta 5e6,
    tied embeddings; without rope_theta its default_theta 2e6."""
    c = ModelConfig.from_dict(SMOLLM3_3B)
    assert c.family == "smollm3" and c.nope_layers == tuple(range(3, 36, 4))
    assert (c.rope_theta, c.rope_scaling, c.tie_word_embeddings, c.sliding_window) == (5e6, None, True, None)
    assert c.differences_from_llama() == ["layers without RoPE"]
    assert ModelConfig.from_dict({k: v for k, v in SMOLLM3_3B.items() if k != "rope_theta"}).rope_theta == 2e6
    explicit = ModelConfig.from_dict({**SMOLLM3_3B, "num_hidden_layers": 4, "no_rope_layers": [0, 1, 1, 0]})
    assert explicit.nope_layers == (0, 3)
    # SmolLM3Config: with use_sliding_window, the layers without RoPE slide
    sliding = ModelConfig.from_dict({**SMOLLM3_3B, "use_sliding_window": True, "sliding_window": 4096})
    assert sliding.sliding_window == 4096 and [i for i in range(36) if sliding.layer_window(i)] == list(c.nope_layers)


@pytest.mark.parametrize("flags", [[1, 0, 1], [1, 0, 1, 2], [1, 0, 1, 0.0], "1010"])
def test_bad_no_rope_layers_are_named(flags):
    with pytest.raises(ModelLoadError, match="field 'no_rope_layers' must list 4 flags of 0 or 1"):
        ModelConfig.from_dict({**SMOLLM3_3B, "num_hidden_layers": 4, "no_rope_layers": flags})


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "nine-launch"])
def test_layers_without_rope_get_the_zero_table(fused_decode):
    from test_family_launches import _fake
    config = ModelConfig.from_pretrained(FIXTURE)
    fake = _fake(config, fused_decode)
    w = fake.weights
    assert w.nope_rope_inv_freq and w.nope_rope_inv_freq != w.rope_inv_freq
    prefill = ForwardBatch.build([list(range(1, 12))], [11], [[5]], 16, is_prefill=True)
    decode = ForwardBatch.build([[3], [4]], [12, 30], [[5], [6, 7]], 16, is_prefill=False)
    for batch in (prefill, decode):
        fake.ops.library.calls.clear()
        fake.model.forward(StepShape(batch.num_tokens, batch.num_seqs, batch.is_prefill,
                                     int(max(batch.query_start[1:] - batch.query_start[:-1]))))
        tables = [(w.nope_rope_inv_freq in ptrs, w.rope_inv_freq in ptrs)
                  for name, args in fake.ops.library.calls if "rope" in name
                  for ptrs in [{int(a) for a in args if not isinstance(a, float)}]]
        assert tables == [(i in config.nope_layers, i not in config.nope_layers)
                          for i in range(config.num_hidden_layers)], (batch.is_prefill, tables)
