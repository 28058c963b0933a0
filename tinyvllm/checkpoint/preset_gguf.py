"""`make-model OUT --preset NAME --gguf TYPE`: a random-weight preset as one GGUF file,
OUT/model.gguf, laid out as llama.cpp lays out the Hugging Face model (checkpoint/gguf_writer.py),
for measuring a quantized model's speed without its real weights. The file carries its config and
tokenizer, so `--model OUT/model.gguf` is all the engine needs; `convert-gguf OUT/model.gguf DIR`
makes the bf16 twin of the same weights.

Which types, as llama.cpp's files of SmolLM2-135M-Instruct have them (its Q4_1 file: Q4_1 layers,
a Q8_0 token_embd, F32 norms): every 1-D tensor F32; every matrix TYPE, but the one the LM head
reads (token_embd when the embeddings are tied, else output), which takes Q8_0 when TYPE is a
4-bit type (Q4_0, Q4_1, Q4_K). The weights are the preset's (model_writer.random_tensor, the same
seed gives the same values as make-model without --gguf) quantized by gguf; Q4_K and Q6_K blocks,
which gguf cannot encode, are random blocks of the same spread (gguf_writer.random_k_blocks).

The vocabulary is the presets' Llama 3 tokenizer fitted to the vocabulary size
(preset_tokenizer.py), with Meta's Llama 3.2 Instruct chat template. What the file does not carry:
the Llama 3.x presets' llama3 RoPE scaling (llama.cpp stores it as a rope_freqs.weight tensor,
which the import refuses), so their GGUF model runs plain RoPE; the shapes, and so the speed, are
the preset's. The preset named after the default model, whose make-model is the real model, here
has random weights of its shapes (SMOLLM2_SHAPES).
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.chat_template import LLAMA32_INSTRUCT_FILE
from tinyvllm.checkpoint.default_model import DEFAULT_MODEL
from tinyvllm.checkpoint.gguf import gguf_name_of
from tinyvllm.checkpoint.gguf_writer import (
    K_QUANTS,
    WRITABLE_TYPES,
    bpe_vocab,
    encode_tensor,
    gguf_layout,
    hparams_metadata,
    random_k_blocks,
    stored_entry,
    vocab_metadata,
    write_gguf_file,
)
from tinyvllm.checkpoint.model_writer import PRESETS, _with_llama3_tokens, random_tensor, value_range
from tinyvllm.checkpoint.preset_tokenizer import fit_tokenizer, tokenizer_source_dir
from tinyvllm.checkpoint.weight_names import EMBED, LM_HEAD, expected_shapes
from tinyvllm.checkpoint.weights import BF16, TensorSpec
from tinyvllm.config import ModelConfig
from tinyvllm.errors import TinyVLLMError

GGUF_FILE = "model.gguf"
# config.json's model_type -> llama.cpp's architecture (Mistral without a window is a Llama to it)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama"}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json (tests check it against the real file's metadata)
SMOLLM2_SHAPES = _with_llama3_tokens({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 49152})
LLAMA3_END_TOKENS = {"<|eot_id|>": "eot", "<|eom_id|>": "eom"}     # llama.cpp's keys for the other stops


def gguf_preset(preset: str) -> dict:
    """The config.json a preset's GGUF file describes."""
    if preset == DEFAULT_MODEL:
        return SMOLLM2_SHAPES
    if preset not in PRESETS:
        raise TinyVLLMError(f"unknown preset {preset!r}; choose one of {', '.join([*sorted(PRESETS), DEFAULT_MODEL])}")
    return PRESETS[preset]


def tensor_type(name: str, shape: tuple[int, ...], qtype: str, config: ModelConfig) -> str:
    """The module docstring's type mix."""
    if len(shape) == 1:
        return "F32"
    head = EMBED if config.tie_word_embeddings else LM_HEAD
    return "Q8_0" if name == head and qtype in FOUR_BIT else qtype


def write_gguf_model(out_dir: str | Path, preset: str, qtype: str, seed: int = 0) -> Path:
    """Write OUT/model.gguf (the module docstring); -> its path."""
    if qtype not in WRITABLE_TYPES:
        raise TinyVLLMError(f"--gguf {qtype!r}: make-model writes {', '.join(WRITABLE_TYPES)}")
    cfg = gguf_preset(preset)
    config = ModelConfig.from_dict(cfg, f"preset {preset}")
    arch = GGUF_ARCHITECTURES.get(config.family)
    if arch is None:
        raise TinyVLLMError(f"--gguf: preset {preset} is of the {config.family} family; make-model writes "
                            f"GGUF files of the {', '.join(sorted(GGUF_ARCHITECTURES))} families only")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def make(name: str, shape: tuple[int, ...], kind: str):
        def encoded() -> np.ndarray:
            if kind in K_QUANTS:
                rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
                return random_k_blocks(kind, shape, value_range(name, shape, config)[1], rng)
            w = random_tensor(TensorSpec(name, shape, BF16), seed, config).astype(np.float32)
            return encode_tensor(gguf_layout(w, name, heads, kv_heads, arch), kind)[0]
        return encoded

    entries = []
    for name, shape in expected_shapes(config).items():
        kind = tensor_type(name, shape, qtype, config)
        try:
            entries.append(stored_entry(gguf_name_of(name, arch), shape, kind, make(name, shape, kind)))
        except ValueError as e:          # a row length that is not whole blocks of the type
            raise TinyVLLMError(f"--gguf {qtype} on preset {preset}: {e}") from None
    tokenizer = fit_tokenizer(json.loads((tokenizer_source_dir() / "tokenizer.json").read_text(encoding="utf-8")),
                              config.vocab_size)
    tokens, types, merges = bpe_vocab(tokenizer, config.vocab_size)
    eos = list(config.eos_token_ids)
    special = {"bos": config.bos_token_id, "eos": eos[0],
               **{LLAMA3_END_TOKENS[tokens[i]]: i for i in eos[1:] if tokens[i] in LLAMA3_END_TOKENS}}
    file_type = "ALL_F32" if qtype == "F32" else "MOSTLY_Q4_K_S" if qtype == "Q4_K" else f"MOSTLY_{qtype}"
    import gguf
    kv = {"general.name": ("string", preset),
          "general.description": ("string", f"random weights (tinyvllm make-model --seed {seed})"),
          "general.file_type": ("uint32", int(gguf.LlamaFileType[file_type])),
          "general.quantization_version": ("uint32", gguf.GGML_QUANT_VERSION),
          **hparams_metadata(cfg, arch),
          # the Llama 3 tokenizer's post-processor prepends <|begin_of_text|>
          **vocab_metadata(tokens, types, merges, special, pre="llama-bpe", add_bos=True,
                           chat_template=LLAMA32_INSTRUCT_FILE.read_text(encoding="utf-8"))}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".{GGUF_FILE}.partial"
    write_gguf_file(partial, arch, kv, entries)
    os.replace(partial, out / GGUF_FILE)          # never a half-written model.gguf
    return out / GGUF_FILE
