"""GGUF (llama.cpp's format) -> a Hugging Face directory that the engine (and transformers)
loads: config.json, bf16 model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json, for llama.cpp's architectures llama, qwen2, qwen3 and gemma3
(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM).

    python -m tinyvllm convert-gguf model.gguf OUT_DIR

The `gguf` package reads the file and dequantizes; this module maps llama.cpp's names and
metadata to Hugging Face's, refuses whatever it cannot carry over faithfully, and undoes the
layout changes llama.cpp's converter (convert_hf_to_gguf.py) makes:
  * llama: q/k rows reordered for llama.cpp's interleaved RoPE (unpermute_rope_rows). Qwen2,
    Qwen3 and Gemma 3 run llama.cpp's NEOX-style RoPE, HF's rotate_half: their rows are as HF's.
  * gemma3: every norm weight (`*norm.weight`: the four per layer, q_norm, k_norm, the final
    norm) is stored with Gemma3RMSNorm's 1 added (Gemma3Model.norm_shift), since llama.cpp
    multiplies by the weight; the import subtracts it in fp32. The converter adds the 1 in the
    checkpoint's dtype, so a bf16 checkpoint's file holds bf16(1 + w); w' = bf16(1 + w) - 1 is
    exact in bf16 (a multiple of 2^-7 or 2^-8 below 1 in magnitude), and the engine's fp32 1 + w'
    is the very multiplier llama.cpp uses.
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
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",       # qwen2
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",   # qwen3, gemma3
}
# Gemma 3's four norms a layer: there llama.cpp's ffn_norm is the pre-feed-forward norm
GEMMA3_LAYER_NAMES = {**LAYER_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# general.architecture -> (config.json's architectures entry, model_type)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# llama.cpp's Gemma 3 constants that its files do not carry (llama-model.cpp): every 6th layer
# full, the sliding layers' RoPE theta, and 27B's (62 layers) query scale hidden / heads
GEMMA3_SWA_PATTERN, GEMMA3_SWA_THETA, GEMMA3_27B_LAYERS = 6, 10000.0, 62


def layer_names(arch: str) -> dict[str, str]:
    return GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES


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
    """config.json for the file's architecture, every field from the metadata. Features llama.cpp
    can describe but the engine does not run are refused, never dropped."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: general.architecture is {arch!r}; tinyvllm converts "
                             f"{', '.join(repr(a) for a in ARCHITECTURES)} GGUF files only")

    def get(key, default=None, required=True):
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{source}: missing metadata {arch}.{key}")
        return value

    if get("expert_count", 0):
        raise ModelLoadError(f"{source}: a mixture-of-experts model ({arch}.expert_count="
                             f"{get('expert_count')}) is not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none" and not (arch == "gemma3" and scaling == "linear"):
        raise ModelLoadError(f"{source}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{source}: per-frequency RoPE factors (tensor rope_freqs.weight, as in "
                             "Llama 3.1+ files) are not supported by the GGUF import")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{source}: {arch}.attention.value_length != key_length is not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{source}: partial rotary embedding ({arch}.rope.dimension_count="
                             f"{get('rope.dimension_count')} of head_dim {head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    layers = int(get("block_count"))
    hf_arch, model_type = ARCHITECTURES[arch]
    # (in the order this module always wrote a Llama's config.json: the default model's conversion
    # is fixed by digest in tests/fixtures/smollm2_golden.json)
    family = {"llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
              "qwen2": {"hidden_act": "silu", "use_sliding_window": False},   # Qwen2 has its q/k/v biases always
              "qwen3": {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
              "gemma3": {}}[arch]
    cfg = {
        "architectures": [hf_arch], "model_type": model_type, **family,
        "vocab_size": int(get("vocab_size", len(tokens) or None)), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),    # llama.cpp's default too
        "rope_scaling": None,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "bfloat16",
    }
    if arch == "gemma3":
        cfg.update(_gemma3_fields(get, layers, hidden, heads, head_dim, scaling))
    for key in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[f"{key}_token_id"] = int(token_id)
    return cfg


def _gemma3_fields(get, layers: int, hidden: int, heads: int, head_dim: int, scaling: str) -> dict:
    """Gemma3TextConfig's fields (its 4.x form) from llama.cpp's gemma3 metadata and constants."""
    window = get("attention.sliding_window", required=False)
    pattern = get("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if window is None:                        # the converter writes none when every layer is full
        sliding = [False] * layers
    elif isinstance(pattern, list):           # a flag per layer
        sliding = [bool(p) for p in pattern]
    else:                                     # llama.cpp's set_swa_pattern(n): every n-th layer full
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    fields = {"hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
              "final_logit_softcapping": get("final_logit_softcapping", required=False),
              "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
              "rope_local_base_freq": _f32(get("rope.freq_base_swa", GEMMA3_SWA_THETA)),
              "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if window is not None:
        fields["sliding_window"] = int(window)
    if scaling == "linear":
        fields["rope_scaling"] = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    return fields


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not
    9.999999747378752e-06): what the original config.json said."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


# ---- weights ----------------------------------------------------------------------------------

def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts, names = gguf_name.split(".", 2), layer_names(arch)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return layer_prefix(int(parts[1])) + names[parts[2]]
    return None


def tensor_map(reader, config: ModelConfig, source: str, arch: str = "llama") -> dict[str, object]:
    """HF name -> the GGUF tensor holding it, each checked for name, type and shape."""
    found = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has no place in a {arch} model")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}; "
                                 f"tinyvllm converts {', '.join(SUPPORTED_TYPES)}")
        found[name] = t
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise ModelLoadError(f"{source}: no tensor for {name!r} (llama.cpp name "
                                 f"{gguf_name_of(name, arch)!r})")
        t = found.pop(name)
        got = tuple(int(d) for d in reversed(t.shape))          # ggml lists dims innermost first
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {t.name!r} has shape {got}, the metadata implies {shape}")
        tensors[name] = t
    if found:            # e.g. blk.N for N >= block_count
        raise ModelLoadError(f"{source}: tensors beyond what the metadata describes: "
                             f"{', '.join(t.name for t in found.values())}")
    return tensors


def gguf_name_of(name: str, arch: str = "llama") -> str:
    reverse = {v: k for k, v in GLOBAL_NAMES.items()}
    if name in reverse:
        return reverse[name]
    layer, part = name[len("model.layers."):].split(".", 1)
    return f"blk.{layer}." + {v: k for k, v in layer_names(arch).items()}[part]


def hf_tensor(t, name: str, config: ModelConfig, arch: str = "llama") -> np.ndarray:
    """One tensor in HF layout as bf16: dequantized to fp32 by gguf, put back as HF holds it
    (module docstring: llama's q/k rows, gemma3's norms), rounded to bf16 (nearest-even)."""
    from gguf import quants
    shape = tuple(int(d) for d in reversed(t.shape))
    w = np.asarray(quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
    return hf_layout(w, name, config, arch).astype(BF16)


def hf_layout(w: np.ndarray, name: str, config: ModelConfig, arch: str = "llama") -> np.ndarray:
    """A tensor put back as Hugging Face holds it (module docstring: llama's q/k rows, gemma3's
    norms). `w` is a float array or a block-quantized matrix's raw rows (uint8 [rows, row_bytes]:
    a row permutation moves whole block rows, checkpoint/gguf_blocks.py)."""
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return unpermute_rope_rows(w, config.num_attention_heads)
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return unpermute_rope_rows(w, config.num_key_value_heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


def _one_or_list(ids: list[int]):
    return None if not ids else ids[0] if len(ids) == 1 else ids


# ---- the whole conversion ---------------------------------------------------------------------

def write_model_files(reader, out: Path, source: str) -> tuple[ModelConfig, dict[str, object], str]:
    """Everything of the Hugging Face directory but the weights (config.json, the tokenizer
    files, generation_config.json) into `out`; -> the config, the checked tensor map and the
    file's architecture."""
    from tinyvllm.checkpoint.gguf_tokenizer import write_tokenizer_files
    meta = metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors}, source)
    config = ModelConfig.from_dict(cfg, source)
    arch = meta["general.architecture"]
    tensors = tensor_map(reader, config, source, arch)
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(meta, config, out, source)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {k: v for k, v in (("bos_token_id", cfg.get("bos_token_id")),
                                    ("eos_token_id", _one_or_list(special.eos_ids)),
                                    ("pad_token_id", cfg.get("pad_token_id"))) if v is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config, tensors, arch


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the Hugging Face directory for a GGUF file into out_dir; -> out_dir."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config, tensors, arch = write_model_files(reader, out, str(gguf_path))   # fails before the big write
    specs = [TensorSpec(name, tuple(expected_shapes(config)[name]), BF16) for name in tensors]
    write_safetensors(out / SINGLE_FILE, specs, lambda s: hf_tensor(tensors[s.name], s.name, config, arch),
                      metadata={"format": "pt", "source": f"converted by tinyvllm from {gguf_path.name}"})
    return out
