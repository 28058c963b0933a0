"""Multimodal checkpoints served text-only: Gemma 3 (Gemma3ForConditionalGeneration: 4B, 12B, 27B),
Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration) and Qwen2-VL / Qwen2.5-VL / Qwen3-VL.
config.json's text_config read with Gemma3TextConfig's defaults (tinyvllm/model_family.py), the
language model's tensors found under either prefix transformers uses, the vision tower not read
(tinyvllm/checkpoint/weight_names.py). The fixtures tests/fixtures/families/gemma3_mm/ and
mistral3_mm/ are such checkpoints, and tests/test_golden_families.py holds their text outputs to
transformers'."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.checkpoint.weights import SafetensorsFile, load_weights, save_safetensors
from tinyvllm.config import LinearRopeScaling, ModelConfig
from tinyvllm.errors import ModelLoadError

FIXTURE = Path(__file__).parent / "fixtures" / "families" / "gemma3_mm"
# config.json of google/gemma-3-4b-it as published (transformers 4.50): text_config lists only what
# differs from Gemma3TextConfig
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False}}


def test_gemma_3_4b_reads_as_transformers_reads_it():
    """The values transformers 5.25's Gemma3Config(**GEMMA3_4B).get_text_config() gives (its
    defaults filling text_config), the top level's dtype and eos ids."""
    c = ModelConfig.from_dict(GEMMA3_4B)
    assert (c.family, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == \
        ("gemma3_text", 262_208, 2560, 10240, 34)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.query_pre_attn_scalar) == (8, 4, 256, 256.0)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.tie_word_embeddings) == (1e-6, 131_072, True)
    assert (c.bos_token_id, c.eos_token_ids, c.dtype) == (2, (1, 106), "bfloat16")
    assert c.sliding_window == 1024 and c.layer_types.count("full_attention") == 5
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert (c.rope_theta, c.rope_scaling) == (1e6, LinearRopeScaling(8.0))          # full layers
    assert (c.sliding_rope_theta, c.sliding_rope_scaling) == (1e4, None)              # sliding layers


def test_the_gemma_3_4b_preset_is_its_language_model():
    """make-model's gemma-3-4b (written out as a Gemma3ForCausalLM config) is the published
    multimodal config's text model, token ids aside (the presets ship the Llama 3 tokenizer)."""
    import dataclasses

    from tinyvllm.checkpoint.model_writer import preset_config
    ids = dict(bos_token_id=0, eos_token_ids=())
    assert dataclasses.replace(preset_config("gemma-3-4b"), **ids) == \
        dataclasses.replace(ModelConfig.from_dict(GEMMA3_4B), **ids)


def test_the_top_level_wins_and_text_config_is_required():
    text = dict(GEMMA3_4B["text_config"], torch_dtype="float32", eos_token_id=1)
    c = ModelConfig.from_dict(dict(GEMMA3_4B, text_config=text))
    assert (c.dtype, c.eos_token_ids) == ("bfloat16", (1, 106))
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration config needs a text_config"):
        ModelConfig.from_dict({k: v for k, v in GEMMA3_4B.items() if k != "text_config"})
    # a field text_config sets to what the engine does not honour is named as for Gemma3ForCausalLM
    with pytest.raises(ModelLoadError, match="final_logit_softcapping"):
        ModelConfig.from_dict(dict(GEMMA3_4B, text_config=dict(text, final_logit_softcapping=30.0)))


def test_other_families_keep_their_required_fields():
    """Only Gemma 3's text config fills the common fields from its class's defaults."""
    with pytest.raises(ModelLoadError, match="missing required field 'vocab_size'"):
        ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
                               "intermediate_size": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
                               "max_position_embeddings": 64})


def _renamed_copy(tmp_path: Path, rename) -> Path:
    """The fixture with every stored tensor name passed through `rename` (None: dropped)."""
    out = tmp_path / "model"
    shutil.copytree(FIXTURE, out)
    stored = SafetensorsFile.open(FIXTURE / "model.safetensors")
    tensors = {new: np.array(stored.get(name)) for name in stored.entries if (new := rename(name))}
    save_safetensors(out / "model.safetensors", tensors)
    return out


def test_language_model_tensors_under_either_prefix(tmp_path):
    """transformers saves language_model.model.* (the fixture); a model's own state dict has
    model.language_model.*: the same weights either way, and the vision tower is not needed."""
    config = ModelConfig.from_pretrained(FIXTURE)
    saved = load_weights(FIXTURE, config)
    assert all(name.startswith("model.") for name in saved)
    as_module = _renamed_copy(tmp_path, lambda n: None if not n.startswith("language_model.model.")
                              else "model.language_model." + n[len("language_model.model."):])
    again = load_weights(as_module, config)
    assert sorted(again) == sorted(saved)
    assert all(np.array_equal(again[n].view(np.uint16), saved[n].view(np.uint16)) for n in saved)


def test_an_untied_head_is_read_from_language_model_lm_head(tmp_path):
    stored = SafetensorsFile.open(FIXTURE / "model.safetensors")
    head = np.asarray(stored.get("language_model.model.embed_tokens.weight")) * 2
    out = _renamed_copy(tmp_path, lambda n: n)
    save_safetensors(out / "model.safetensors", {**{n: np.array(stored.get(n)) for n in stored.entries},
                                                 "language_model.lm_head.weight": head})
    cfg = json.loads((out / "config.json").read_text())
    text = dict(cfg["text_config"], tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False, text_config=text)))
    config = ModelConfig.from_pretrained(out)
    assert not config.tie_word_embeddings
    weights = load_weights(out, config)
    assert np.array_equal(weights["lm_head.weight"].view(np.uint16), head.view(np.uint16))


def test_inspect_marks_the_tensors_it_does_not_read():
    from tinyvllm.model_report import checkpoint_tensor_lines
    lines = checkpoint_tensor_lines(FIXTURE)
    unread = [line.split()[0] for line in lines if line.endswith("(not read)")]
    assert unread and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in unread)
    assert not [line for line in checkpoint_tensor_lines(FIXTURE.parent / "qwen3") if line.endswith("(not read)")]


def test_mistral_small_3_reads_as_its_mistral_language_model():
    """A Mistral-Small-3.1-shaped config.json: its text_config is a MistralConfig, untied."""
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
           "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                           "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                           "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                           "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
           "torch_dtype": "bfloat16", "vision_config": {"model_type": "pixtral"}}
    c = ModelConfig.from_dict(cfg)
    assert (c.family, c.hidden_size, c.head_dim, c.rope_theta, c.sliding_window, c.tie_word_embeddings) == \
        ("mistral", 5120, 128, 1e9, None, False)
    assert c.differences_from_llama() == []


def test_qwen2_5_vl_flat_config_reads_as_its_qwen2_language_model():
    """A Qwen2.5-VL-7B-shaped config.json in the flat form the Hub keeps (the text model's fields at
    the top, rope_scaling of type mrope): a Qwen2 whose multimodal RoPE is plain RoPE on text, as
    Qwen2_5_VLConfig reads it."""
    cfg = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 128000,
           "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584}}
    c = ModelConfig.from_dict(cfg)
    assert (c.family, c.hidden_size, c.head_dim, c.qkv_bias, c.rope_theta, c.rope_scaling, c.sliding_window) == \
        ("qwen2", 3584, 128, True, 1e6, None, None)
    assert ModelConfig.from_dict({**cfg, "architectures": ["Qwen2VLForConditionalGeneration"],
                                  "model_type": "qwen2_vl"}) == c
