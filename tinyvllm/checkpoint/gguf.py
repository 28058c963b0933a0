"""GGUF (llama.cpp's format) -> a Hugging Face Llama directory that the engine (and transformers)
loads: config.json, bf16 model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json.

    python -m tinyvllm convert-gguf model.gguf OUT_DIR

The `gguf` package reads the file and dequantizes; this module maps llama.cpp's names and
metadata to Hugging Face's, refuses whatever it cannot carry over faithfully, and undoes the
one layout change llama.cpp makes to Llama weights (the q/k row order, see unpermute_rope_rows).
The file is opened through gguf_header.py, which checks its header first; the tokenizer files
are gguf_tokenizer.py's.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.gguf_header import open_gguf
from tinyvllm.checkpoint.weight_names import EMBED, FINAL_NORM, LM_HEAD, expected_shapes, layer_prefix
from tinyvllm.checkpoint.weights import BF16, SINGLE_FILE, TensorSpec, write_safetensors
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError

# tensor types converted; gguf.quants dequantizes each of them in numpy. The tests round-trip
# every type gguf can also quantize (all but the K-quants, whose decoding is gguf's alone).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp tensor name -> Hugging Face name (per layer: the part after "blk.N.")
GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# ---- the q/k row order ------------------------------------------------------------------------
# Hugging Face's Llama rotates dimension i of a head with dimension i + D/2 ("rotate_half");
# llama.cpp rotates adjacent pairs (2i, 2i+1), as Meta's original checkpoints did. So llama.cpp's
# converter reorders the rows of q_proj/k_proj, per head, so that HF row (half * D/2 + i) lands at
# row (2i + half): viewed as [heads, 2, D/2] the HF rows are transposed to [heads, D/2, 2].
# The inverse reads the GGUF rows as [heads, D/2, 2] and transposes back to [heads, 2, D/2].

def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF layout -> llama.cpp layout (what llama.cpp's converter does; used to write test files)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp layout -> HF layout: the inverse of permute_rope_rows."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- metadata -------------------------------------------------------------------------------

def metadata(reader) -> dict:
    """Every key/value of the file as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


# ---- config -----------------------------------------------------------------------------------

def hf_config(meta: dict, tensor_names: set[str], source: str) -> dict:
    """config.json for a LlamaForCausalLM, every field from the metadata. Llama features
    llama.cpp can describe but the engine does not run are refused, never dropped."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{source}: general.architecture is {arch!r}; tinyvllm converts "
                             "Llama-architecture GGUF files only ('llama')")

    def get(key, default=None, required=True):
        value = meta.get(f"llama.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{source}: missing metadata llama.{key}")
        return value

    if get("expert_count", 0):
        raise ModelLoadError(f"{source}: a mixture-of-experts model (llama.expert_count="
                             f"{get('expert_count')}) is not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{source}: RoPE scaling {scaling!r} (llama.rope.scaling.type) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{source}: per-frequency RoPE factors (tensor rope_freqs.weight, as in "
                             "Llama 3.1+ files) are not supported by the GGUF import")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{source}: llama.attention.value_length != key_length is not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{source}: partial rotary embedding (llama.rope.dimension_count="
                             f"{get('rope.dimension_count')} of head_dim {head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(get("vocab_size", len(tokens) or None))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),    # llama.cpp's default too
        "rope_scaling": None,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "bfloat16",
    }
    for key in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[f"{key}_token_id"] = int(token_id)
    return cfg


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not
    9.999999747378752e-06): what the original config.json said."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


# ---- weights ----------------------------------------------------------------------------------

def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return layer_prefix(int(parts[1])) + LAYER_NAMES[parts[2]]
    return None


def tensor_map(reader, config: ModelConfig, source: str) -> dict[str, object]:
    """HF name -> the GGUF tensor holding it, each checked for name, type and shape."""
    found = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has no place in a Llama model "
                                 "(biases, extra norms and other architectures are not supported)")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}; "
                                 f"tinyvllm converts {', '.join(SUPPORTED_TYPES)}")
        found[name] = t
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise ModelLoadError(f"{source}: no tensor for {name!r} (llama.cpp name "
                                 f"{gguf_name_of(name)!r})")
        t = found.pop(name)
        got = tuple(int(d) for d in reversed(t.shape))          # ggml lists dims innermost first
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has shape {got}, the metadata implies {shape}")
        tensors[name] = t
    if found:            # e.g. blk.N for N >= block_count
        raise ModelLoadError(f"{source}: tensors beyond what the metadata describes: "
                             f"{', '.join(t.name for t in found.values())}")
    return tensors


def gguf_name_of(name: str) -> str:
    reverse = {v: k for k, v in GLOBAL_NAMES.items()}
    if name in reverse:
        return reverse[name]
    layer, part = name[len("model.layers."):].split(".", 1)
    return f"blk.{layer}." + {v: k for k, v in LAYER_NAMES.items()}[part]


def hf_tensor(t, name: str, config: ModelConfig) -> np.ndarray:
    """One tensor in HF layout as bf16: dequantized to fp32 by gguf, q/k rows put back in
    HF order, rounded to bf16 (nearest-even)."""
    from gguf import quants
    shape = tuple(int(d) for d in reversed(t.shape))
    w = np.asarray(quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
    return hf_layout(w, name, config).astype(BF16)


def hf_layout(w: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows in Hugging Face order: llama.cpp's q/k row order undone. `w` is a float
    matrix or a block-quantized one's raw rows (uint8 [rows, row_bytes]: a row permutation
    moves whole block rows, checkpoint/gguf_blocks.py)."""
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rope_rows(w, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rope_rows(w, config.num_key_value_heads)
    return w


def _one_or_list(ids: list[int]):
    return None if not ids else ids[0] if len(ids) == 1 else ids


# ---- the whole conversion ---------------------------------------------------------------------

def write_model_files(reader, out: Path, source: str) -> tuple[ModelConfig, dict[str, object]]:
    """Everything of the Hugging Face directory but the weights (config.json, the tokenizer
    files, generation_config.json) into `out`; -> the config and the checked tensor map."""
    from tinyvllm.checkpoint.gguf_tokenizer import write_tokenizer_files
    meta = metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors}, source)
    config = ModelConfig.from_dict(cfg, source)
    tensors = tensor_map(reader, config, source)
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(meta, config, out, source)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {k: v for k, v in (("bos_token_id", cfg.get("bos_token_id")),
                                    ("eos_token_id", _one_or_list(special.eos_ids)),
                                    ("pad_token_id", cfg.get("pad_token_id"))) if v is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config, tensors


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the Hugging Face directory for a Llama GGUF file into out_dir; -> out_dir."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config, tensors = write_model_files(reader, out, str(gguf_path))   # fails before the big write
    specs = [TensorSpec(name, tuple(expected_shapes(config)[name]), BF16) for name in tensors]
    write_safetensors(out / SINGLE_FILE, specs, lambda s: hf_tensor(tensors[s.name], s.name, config),
                      metadata={"format": "pt", "source": f"converted by tinyvllm from {gguf_path.name}"})
    return out
