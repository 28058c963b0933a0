"""Random-weight models in Hugging Face layout: config.json, safetensors, the genuine Llama 3
tokenizer, Meta's Llama 3.2 Instruct chat template (chat_template.jinja), generation_config.json.
Used for tests, benchmarks and demos when real weights are not at hand; the presets carry the
real models' exact shapes and configs, Llama 3.x and the other families (tinyvllm/model_family.py).
Every preset ships the Llama 3 tokenizer (checkpoint/preset_tokenizer.py), so its config's
bos/eos ids are that tokenizer's, fitted to the preset's vocabulary.

Weight scale, chosen so a random model behaves like a trained one numerically:
  * every projection has std 1/sqrt(fan_in), so a normalized input (rms 1) gives outputs of rms
    ~1 and MLP outputs of rms <1; q and k get an extra sqrt(ATTENTION_SHARPNESS) each, so scores
    (after the 1/sqrt(head_dim) scale) have std ~3. With std-1 scores attention is near-uniform,
    every position sees the same context average, and greedy decoding repeats one token forever,
    which would make batching and paging bugs invisible in token-level tests;
  * the embedding has std EMBED_GAIN/sqrt(hidden): the residual stream starts small and each
    layer adds O(1), so hidden-state rms grows moderately (~sqrt(layers)) and the last token's
    own embedding does not dominate; logits, being normed-hidden . embedding rows, then have a
    std of about EMBED_GAIN whatever the width;
  * norm weights are 1 +- 10% (Gemma 3's, which multiply by 1 + w, are 0 +- 10%), so a kernel
    that forgets the weight is caught; biases are uniform with std BIAS_STD;
  * the families' own tensors and formulas move some of these scales (value_range).
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.default_model import DEFAULT_MODEL, default_gguf_path
from tinyvllm.checkpoint.preset_tokenizer import (  # noqa: F401  (tokenizer_source_dir: for importers)
    LLAMA3_BOS,
    LLAMA3_EOS,
    special_id,
    tokenizer_source_dir,
    write_tokenizer_files,
)
from tinyvllm.checkpoint.weight_names import FINAL_NORM, expected_shapes
from tinyvllm.checkpoint.weights import BF16, INDEX_FILE, TensorSpec, write_checkpoint
from tinyvllm.config import ModelConfig
from tinyvllm.errors import TinyVLLMError

EMBED_GAIN = 2.5
ATTENTION_SHARPNESS = 3.0
NORM_JITTER = 0.1
BIAS_STD = 0.1
MAX_SHARD_BYTES = 2 * 1024**3         # shard above ~2 GB, as HF checkpoints do
CHUNK_ELEMENTS = 1 << 22              # generate 4M values (16 MB of fp32) at a time


def _llama3(**shape) -> dict:
    """An HF config.json for a Llama 3.x model with the given shape fields."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": LLAMA3_BOS, "eos_token_id": list(LLAMA3_EOS),
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    }
    rope_factor = shape.pop("rope_factor", None)
    if rope_factor is not None:
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=rope_factor)
    cfg.update(shape)
    return cfg


PRESETS: dict[str, dict] = {
    # small enough for the numpy backend in CI, but with the real vocabulary and GQA
    "tiny": _llama3(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=4096),
    "llama-3.2-1b": _llama3(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3.2-3b": _llama3(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                            num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    "llama-3.1-8b": _llama3(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            tie_word_embeddings=False, rope_factor=8.0),
}


def _with_llama3_tokens(cfg: dict) -> dict:
    """A family's config with the bos/eos ids of the Llama 3 tokenizer the preset ships."""
    v = cfg["vocab_size"]
    return dict(cfg, bos_token_id=special_id(LLAMA3_BOS, v), eos_token_id=[special_id(i, v) for i in LLAMA3_EOS])


# The other families' presets: config.json of each public checkpoint as published (transformers
# 4.x form), with the token ids of the tokenizer every preset ships.
PRESETS.update({
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": _with_llama3_tokens({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936}),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": _with_llama3_tokens({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}),
    # google/gemma-3-1b-it
    "gemma-3-1b": _with_llama3_tokens({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
        "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}),
    # google/gemma-3-4b-it's language model (its config.json's text_config, whose absent fields
    # take Gemma3TextConfig's defaults, written out; the checkpoint itself is multimodal)
    "gemma-3-4b": _with_llama3_tokens({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2560, "intermediate_size": 10240,
        "max_position_embeddings": 131072, "num_attention_heads": 8, "num_hidden_layers": 34,
        "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000, "sliding_window": 1024, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "vocab_size": 262208}),
    # HuggingFaceTB/SmolLM3-3B's shapes (no RoPE on every 4th layer; the Llama 3 vocabulary)
    "smollm3-3b": _with_llama3_tokens({
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 65536,
        "mlp_bias": False, "no_rope_layer_interval": 4, "num_attention_heads": 16, "num_hidden_layers": 36,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 128256}),
    # microsoft/phi-4's shapes (q/k/v and gate/up stored fused, no window)
    "phi-4": _with_llama3_tokens({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 17920, "max_position_embeddings": 16384, "num_attention_heads": 40,
        "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 250000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 100352}),
    # mistralai/Mistral-7B-Instruct-v0.3 (no sliding window: the Llama forward pass exactly)
    "mistral-7b": _with_llama3_tokens({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32768}),
})

# every name make-model --preset takes: the random-weight presets and the real default model
PRESET_NAMES = (*sorted(PRESETS), DEFAULT_MODEL)


def preset_config(preset: str) -> ModelConfig:
    if preset not in PRESETS:
        raise TinyVLLMError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    return ModelConfig.from_dict(PRESETS[preset], f"preset {preset}")


def value_range(name: str, shape: tuple[int, ...], config: ModelConfig | None = None) -> tuple[float, float]:
    """(centre, half-width) of the uniform values of one tensor (the module docstring's scales).
    For the families (config given): q/k norms, which undo the q/k projections' scale, carry the
    attention sharpness instead; an embedding scaled up by the model (Gemma 3's sqrt(hidden)) is
    drawn that much smaller, so that the residual stream starts as small as Llama's, and a tied
    model's final norm multiplies by that scale, so that the logits keep their std of EMBED_GAIN;
    norms that multiply by (1 + w) are drawn one less."""
    offset = config.norm_weight_offset if config else 0.0
    embed_scale = config.embedding_scale or 1.0 if config else 1.0
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return np.sqrt(ATTENTION_SHARPNESS) - offset, NORM_JITTER
    if name.endswith("norm.weight"):
        gain = embed_scale if name == FINAL_NORM and config and config.tie_word_embeddings else 1.0
        return gain - offset, NORM_JITTER
    if name.endswith(".bias"):
        return 0.0, BIAS_STD * np.sqrt(3.0)
    gain = EMBED_GAIN / embed_scale if "embed_tokens" in name else EMBED_GAIN if "lm_head" in name \
        else np.sqrt(ATTENTION_SHARPNESS) if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
    return 0.0, gain / np.sqrt(shape[1]) * np.sqrt(3.0)      # uniform(-a, a) has std a / sqrt(3)


def random_tensor(spec: TensorSpec, seed: int, config: ModelConfig | None = None) -> np.ndarray:
    """The bf16 values of one tensor, generated in chunks so that only the bf16 result is ever
    whole in memory. Seeded by (seed, name): the same tensor whatever the order or sharding.
    config: the model's, where its family changes the scales (value_range); None: Llama's."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    out = np.empty(spec.shape, BF16)
    flat = out.reshape(-1)
    center, half_width = value_range(spec.name, spec.shape, config)
    # uniform rather than normal: 7x faster to draw, and the model only needs the right scale
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = rng.random(min(CHUNK_ELEMENTS, flat.size - start), dtype=np.float32)
        chunk -= np.float32(0.5)
        chunk *= np.float32(2 * half_width)
        chunk += np.float32(center)
        flat[start:start + chunk.size] = chunk
    return out


def write_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a random-weight model of the preset's shape, loadable by tinyvllm and by HF; the
    DEFAULT_MODEL preset is the real SmolLM2-135M-Instruct instead, converted from its GGUF."""
    if preset == DEFAULT_MODEL:
        from tinyvllm.checkpoint.gguf import convert_gguf
        return convert_gguf(default_gguf_path(), out_dir)
    config = preset_config(preset)
    tokenizer_dir = tokenizer_source_dir()     # fail before writing gigabytes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)          # a previous, differently sharded model

    hf_config = dict(PRESETS[preset], transformers_version="4.45.0", use_cache=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out, config.vocab_size, tokenizer_dir)

    specs = [TensorSpec(name, shape, BF16) for name, shape in expected_shapes(config).items()]
    write_checkpoint(out, specs, lambda s: random_tensor(s, seed, config), max_shard_bytes)
    return out
