"""Tiny synthetic GGUF files for the import tests: a small byte-level vocabulary, a tiny Llama
config and bf16-exact weights, written through the package's own writer
(tinyvllm/checkpoint/gguf_writer.py: llama.cpp's names, dimension order, q/k row order, Gemma 3's
shifted norms, norms in F32, the vocabulary as metadata) with the knobs the tests need."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint.gguf import gguf_name_of
from tinyvllm.checkpoint.gguf_tokenizer import byte_alphabet
from tinyvllm.checkpoint.gguf_writer import (
    array_entry,
    encode_tensor,
    gguf_layout,
    hparams_metadata,
    vocab_metadata,
    write_gguf_file,
)
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


def write_gguf(path: Path, cfg: dict, weights: dict[str, np.ndarray], *, qtype: str = "F32",
               vocab=None, arch: str = "llama", tokenizer_pre: str = "smollm", add_bos: bool = False,
               chat_template: str | None = CHATML, extra_tensors: dict | None = None,
               drop: tuple[str, ...] = (), meta: dict | None = None) -> Path:
    """Write `weights` (HF names and layout) as llama.cpp would (tinyvllm/checkpoint/gguf_writer.py).
    `meta` adds or overrides key/values ({key: (kind, value)}, kind a GGUFWriter add_* suffix such
    as "uint32"); `drop` leaves out the tensors whose llama.cpp name (less ".weight") ends so;
    `extra_tensors` ({llama.cpp name: (array, raw type)}) are added after the others."""
    tokens, merges, types = vocab or tiny_vocab()
    eos = cfg["eos_token_id"]
    kv = {**hparams_metadata(cfg, arch),
          **vocab_metadata(tokens, types, merges, {"bos": cfg["bos_token_id"], "eos": eos, "padding": eos},
                           pre=tokenizer_pre, add_bos=add_bos, chat_template=chat_template)}
    kv.update(meta or {})
    entries = []
    for name, value in weights.items():
        gname = gguf_name_of(name, arch)
        if gname.rsplit(".", 1)[0].endswith(drop):
            continue
        value = gguf_layout(value, name, cfg["num_attention_heads"], cfg["num_key_value_heads"], arch)
        entries.append(array_entry(gname, *encode_tensor(value, "F32" if value.ndim == 1 else qtype)))
    entries += [array_entry(gname, array, raw) for gname, (array, raw) in (extra_tensors or {}).items()]
    return write_gguf_file(path, arch, kv, entries)
