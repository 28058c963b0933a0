"""make-model presets of the families beside Llama: the published shapes, a tokenizer whose every
id indexes the embedding, weights at the scales the family's norms need, end to end on the numpy
backend; and the CUDA backend refusing, in one line, what its kernels do not compute."""
import json

import numpy as np
import pytest

from tinyvllm.checkpoint.model_writer import PRESETS, preset_config, write_model
from tinyvllm.checkpoint.preset_tokenizer import fit_tokenizer, special_id, tokenizer_source_dir, write_tokenizer_files
from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError

# counted from the published checkpoints' tensor shapes
EXPECTED_PARAMETERS = {"qwen3-0.6b": 596_049_920, "qwen2.5-0.5b": 494_032_768, "gemma-3-1b": 999_885_952,
                       "gemma-3-4b": 3_880_263_168, "smollm3-3b": 3_075_098_624, "phi-4": 14_659_507_200,
                       "mistral-7b": 7_248_023_552}
# (gemma-3-4b: its language model, as transformers 5.25's Gemma3ForCausalLM of its text_config counts
# it; smollm3-3b and phi-4: as their SmolLM3ForCausalLM / Phi3ForCausalLM count the preset's config)
TEXTS = ["Hello, world!", "The capital of France is Paris.", "def f(x):\n    return x ** 2\n",
         "Grüße aus München – schön! 日本語のテキスト 😀", "   spaces\tand\ttabs\n\n"]


@pytest.mark.parametrize("preset", sorted(EXPECTED_PARAMETERS))
def test_preset_shapes_are_the_published_ones(preset):
    config = preset_config(preset)
    assert config.num_parameters == EXPECTED_PARAMETERS[preset]
    assert sum(int(np.prod(s)) for s in expected_shapes(config).values()) == config.num_parameters
    assert config.bos_token_id == special_id(128000, config.vocab_size)


def test_each_preset_is_its_family():
    families = {p: preset_config(p).family for p in EXPECTED_PARAMETERS}
    assert families == {"qwen3-0.6b": "qwen3", "qwen2.5-0.5b": "qwen2", "gemma-3-1b": "gemma3_text",
                        "gemma-3-4b": "gemma3_text", "smollm3-3b": "smollm3", "phi-4": "phi3", "mistral-7b": "mistral"}
    gemma = preset_config("gemma-3-1b")
    assert gemma.sliding_window == 512 and gemma.layer_types.count("full_attention") == 4
    assert preset_config("mistral-7b").differences_from_llama() == []


@pytest.fixture(scope="module")
def mistral_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-tokenizer")
    write_tokenizer_files(folder, 32768)
    return folder


def test_tokenizer_fitted_to_a_smaller_vocabulary(mistral_tokenizer_dir):
    """Mistral's 32,768 ids: every id the tokenizer produces is below it, text round-trips, the
    special tokens sit at the top, and the chat template's tokens encode to them."""
    from tokenizers import Tokenizer as Backend
    tok = Backend.from_file(str(mistral_tokenizer_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 32768
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids[0] == 32512 and max(ids) < 32512 + 256 and max(ids[1:]) < 32512     # <|begin_of_text|> first
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.token_to_id("<|eot_id|>") == special_id(128009, 32768) == 32521
    config = json.loads((mistral_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["32521"]["content"] == "<|eot_id|>"


def test_fitting_keeps_merges_whose_parts_are_kept():
    full = json.loads((tokenizer_source_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    fitted = fit_tokenizer(full, 4096)
    vocab = fitted["model"]["vocab"]
    assert len(vocab) == 4096 - 256 and max(vocab.values()) == 4096 - 256 - 1
    for merge in fitted["model"]["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        assert a in vocab and b in vocab and a + b in vocab
    assert fit_tokenizer(full, 151936)["model"] is full["model"]        # a larger vocabulary: as it is
    with pytest.raises(ModelLoadError, match="too small"):
        fit_tokenizer(full, 300)


# shrunk copies of the presets (write_model's own path, tokenizer included) for the numpy backend
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}


@pytest.mark.parametrize("preset, vocab", [("gemma-3-1b", 131072), ("mistral-7b", 32768),
                                           ("qwen2.5-0.5b", 128256), ("qwen3-0.6b", 128256)])
def test_small_copy_of_each_preset_runs_end_to_end(preset, vocab, tmp_path, monkeypatch):
    cfg = {**PRESETS[preset], **SMALL, "vocab_size": vocab, "sliding_window": 8 if preset == "gemma-3-1b" else None}
    cfg.update(bos_token_id=special_id(128000, vocab), eos_token_id=[special_id(i, vocab) for i in (128001, 128008, 128009)])
    monkeypatch.setitem(PRESETS, "small", cfg)
    folder = write_model(tmp_path, "small", seed=1)
    config = ModelConfig.from_pretrained(folder)
    assert config.family == preset_config(preset).family
    weights = load_weights(folder, config)
    norms = np.stack([weights[f"model.layers.{i}.input_layernorm.weight"].astype(np.float32) for i in range(2)])
    center = 1.0 - config.norm_weight_offset                    # Gemma's (1 + w): w around 0
    assert abs(norms.mean() - center) < 0.02 and 0.05 < norms.std() < 0.07
    if config.qkv_bias:
        assert 0.08 < weights["model.layers.0.self_attn.q_proj.bias"].astype(np.float32).std() < 0.12

    from tinyvllm import LLM, SamplingParams
    llm = LLM(folder, device="cpu", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Hello there"}], params)[0]
    assert out.prompt_token_ids[0] == config.bos_token_id and len(out.outputs[0].token_ids) == 12
    assert max(out.outputs[0].token_ids) < vocab and len(set(out.outputs[0].token_ids)) > 2
    assert Tokenizer.from_pretrained(folder).eos_token_ids == tuple(sorted(config.eos_token_ids))


def test_cuda_backend_refuses_a_head_shape_without_kernels():
    """Before touching the GPU (and before the weights load): one line naming the head shape the
    attention kernels lack; every family's fixture passes."""
    import json
    from pathlib import Path

    from tinyvllm.engine.runners import check_cuda_support
    folders = sorted((Path(__file__).parent / "fixtures" / "families").iterdir())
    for folder in folders:
        check_cuda_support(ModelConfig.from_pretrained(folder))
    config = json.loads((folders[0] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no attention kernels for head_dim 96 with 2 query heads"):
        check_cuda_support(ModelConfig.from_dict({**config, "head_dim": 96}))
