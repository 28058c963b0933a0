"""Tiny synthetic GGUF files for the import tests, written with gguf.GGUFWriter the way
llama.cpp's converter lays a Hugging Face model out: llama.cpp tensor names, ggml dimension
order, q/k rows permuted for interleaved RoPE (llama only), Gemma 3's norms stored with their 1
added, norms in F32, the vocabulary as metadata."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint.gguf import GLOBAL_NAMES, layer_names, permute_rope_rows
from tinyvllm.checkpoint.gguf_tokenizer import byte_alphabet
from tinyvllm.checkpoint.weight_names import expected_shapes
from tinyvllm.config import ModelConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "ll o", "Ġ t", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "i n", "Ġ in"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): the 256 byte tokens, one token per merge, then three
    control tokens, as a byte-level BPE vocabulary is stored in GGUF."""
    tokens = [byte_alphabet()[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + SPECIALS, list(MERGES), types


def tiny_hf_config(vocab_size: int, **changes) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": True, "bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1}
    cfg.update(changes)
    return cfg


def tiny_hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights in HF layout whose values are exactly bf16 (so an F32 file converts back
    bit for bit)."""
    rng = np.random.default_rng(seed)
    config = ModelConfig.from_dict(cfg)
    out = {}
    for name, shape in expected_shapes(config).items():
        w = rng.normal(1.0 if name.endswith("norm.weight") else 0.0, 0.1, shape).astype(np.float32)
        out[name] = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


def gguf_names(arch: str = "llama") -> dict[str, str]:
    """HF tensor-name suffix -> llama.cpp name (per layer, after "blk.N.")."""
    return {v: k for k, v in {**GLOBAL_NAMES, **layer_names(arch)}.items()}


def encode_tensor(w: np.ndarray, qtype: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor: w stored as `qtype`."""
    import gguf
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), t), t


def write_gguf(path: Path, cfg: dict, weights: dict[str, np.ndarray], *, qtype: str = "F32",
               vocab=None, arch: str = "llama", tokenizer_pre: str = "smollm", add_bos: bool = False,
               chat_template: str | None = CHATML, extra_tensors: dict | None = None,
               drop: tuple[str, ...] = (), meta: dict | None = None) -> Path:
    """Write `weights` (HF names and layout) as llama.cpp would. `meta` adds or overrides
    key/values ({key: (kind, value)}, kind a GGUFWriter add_* suffix such as "uint32")."""
    import gguf
    tokens, merges, types = vocab or tiny_vocab()
    spm = merges is None                    # a sentencepiece vocabulary: merges None, scores in meta
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    a = f"{arch}."
    kv = {a + "block_count": ("uint32", cfg["num_hidden_layers"]),
          a + "context_length": ("uint32", cfg["max_position_embeddings"]),
          a + "embedding_length": ("uint32", cfg["hidden_size"]),
          a + "feed_forward_length": ("uint32", cfg["intermediate_size"]),
          a + "attention.head_count": ("uint32", heads), a + "attention.head_count_kv": ("uint32", kv_heads),
          a + "rope.freq_base": ("float32", cfg["rope_theta"]),
          a + "attention.layer_norm_rms_epsilon": ("float32", cfg["rms_norm_eps"]),
          a + "vocab_size": ("uint32", cfg["vocab_size"]), a + "rope.dimension_count": ("uint32", cfg["head_dim"]),
          "tokenizer.ggml.model": ("string", "llama" if spm else "gpt2"),
          "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type": ("array", types),
          "tokenizer.ggml.bos_token_id": ("uint32", cfg["bos_token_id"]),
          "tokenizer.ggml.eos_token_id": ("uint32", cfg["eos_token_id"]),
          "tokenizer.ggml.padding_token_id": ("uint32", cfg["eos_token_id"]),
          "tokenizer.ggml.add_bos_token": ("bool", add_bos)}
    if not spm:
        kv.update({"tokenizer.ggml.pre": ("string", tokenizer_pre), "tokenizer.ggml.merges": ("array", merges)})
    if chat_template is not None:
        kv["tokenizer.chat_template"] = ("string", chat_template)
    kv.update(meta or {})
    for key, (kind, value) in kv.items():
        getattr(w, f"add_{kind}")(key, list(value) if kind == "array" else value)
    names = gguf_names(arch)
    for name, value in weights.items():
        if name.startswith("model.layers."):
            layer, part = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{names[part]}"
        else:
            gname = names[name]
        if gname.rsplit(".", 1)[0].endswith(drop):
            continue
        if arch == "llama" and part_of(name, "q_proj"):
            value = permute_rope_rows(value, heads)
        elif arch == "llama" and part_of(name, "k_proj"):
            value = permute_rope_rows(value, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            value = value + np.float32(1.0)          # Gemma3Model.norm_shift
        array, raw = encode_tensor(value, "F32" if value.ndim == 1 else qtype)
        w.add_tensor(gname, array, raw_dtype=raw)
    for gname, (array, raw) in (extra_tensors or {}).items():
        w.add_tensor(gname, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def part_of(name: str, part: str) -> bool:
    return name.endswith(f"self_attn.{part}.weight")
