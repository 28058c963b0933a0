"""GGUF files written as llama.cpp's converter (convert_hf_to_gguf.py) writes a Hugging Face
model: llama.cpp's tensor names, ggml's dimension order (innermost first; gguf's writer reverses
numpy's shape), a Llama's q/k rows permuted for llama.cpp's interleaved RoPE, Gemma 3's norms
stored with their 1 added, 1-D tensors in F32, the hyperparameters and the vocabulary as
metadata. It is the inverse of checkpoint/gguf.py, whose names and row permutation it uses.
`make-model --gguf` (model_writer.write_gguf_model) and the tests' small files
(tests/gguf_helpers.py) both write through it.

Tensors are streamed: every tensor's name, shape and type goes into the header first, then each
is made, encoded and written in turn, so only one tensor is ever whole in memory.

Encoding: F32 and F16 as arrays; Q8_0, Q4_0 and Q4_1 by gguf.quants.quantize (llama.cpp's
reference quantizers, in numpy). gguf cannot encode the K-quants: a random-weight model's Q4_K
and Q6_K blocks are drawn at random instead (random_k_blocks).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tinyvllm.checkpoint.gguf import permute_rope_rows
from tinyvllm.checkpoint.gguf_tokenizer import CONTROL, USER_DEFINED

log = logging.getLogger("tinyvllm")
WRITABLE_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q6_K")
NORMAL, UNUSED = 1, 5                 # llama.cpp's token types beside CONTROL and USER_DEFINED
PROGRESS_SECONDS = 10.0               # at most one progress line this often


def gguf_layout(w: np.ndarray, name: str, heads: int, kv_heads: int, arch: str = "llama") -> np.ndarray:
    """A tensor in Hugging Face layout as llama.cpp's converter stores it (gguf.hf_layout undoes it)."""
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return permute_rope_rows(w, heads)
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return permute_rope_rows(w, kv_heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w + np.float32(1.0)          # Gemma3Model.norm_shift
    return w


def encode_tensor(w: np.ndarray, qtype: str):
    """(array, raw type) as GGUFWriter takes them: the float tensor w stored as `qtype`."""
    import gguf
    if qtype == "F32":
        return np.asarray(w, np.float32), None
    if qtype == "F16":
        return np.asarray(w, np.float16), None
    if qtype in K_QUANTS:
        raise ValueError(f"gguf cannot quantize {qtype}; random_k_blocks draws random blocks")
    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(np.asarray(w, np.float32), t), t


def random_k_blocks(qtype: str, shape: tuple[int, int], half_width: float, rng) -> np.ndarray:
    """uint8 [rows, row bytes] of random Q4_K / Q6_K blocks (random codes, sub-block scales and
    mins) whose fp16 factors make the weights' std that of uniform(-half_width, half_width)
    (tinyvllm/quant/gguf_kquants.py has the layouts): w = d sc c - dmin mn with sc, mn in 0..63 and
    c in 0..15 for Q4_K (dmin = 7.5 d centres it; std ~256 d), w = d sc q with sc in -128..127 and
    q in -32..31 for Q6_K (std ~1367 d)."""
    rows, cols = shape
    block_bytes, per_std = {"Q4_K": (144, 256.0), "Q6_K": (210, 1367.0)}[qtype]
    raw = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    d = np.float16(half_width / np.sqrt(3.0) / per_std)
    fields = {"Q4_K": ((0, d), (2, np.float16(7.5 * d))), "Q6_K": ((208, d),)}[qtype]
    for offset, value in fields:
        raw[:, offset:offset + 2] = np.array([value], "<f2").view(np.uint8)
    return raw.reshape(rows, -1)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its llama.cpp name, its array as stored (shape and dtype: uint8 block
    rows for a block type), the block type (None: F32/F16, told by the dtype), and the function
    that makes that array, called once when the tensor is written."""
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    raw: object
    make: Callable[[], np.ndarray]


def stored_entry(name: str, shape: tuple[int, ...], qtype: str, make: Callable[[], np.ndarray]) -> TensorEntry:
    """The entry of a tensor of `shape` (Hugging Face order) stored as qtype."""
    import gguf
    if qtype in ("F32", "F16"):
        return TensorEntry(name, tuple(shape), np.dtype(np.float32 if qtype == "F32" else np.float16), None, make)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    if shape[-1] % block:
        raise ValueError(f"{name}: rows of {shape[-1]} weights are not whole {qtype} blocks of {block}")
    return TensorEntry(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), t, make)


def array_entry(name: str, array: np.ndarray, raw=None) -> TensorEntry:
    """The entry of an array already encoded (encode_tensor's result)."""
    return TensorEntry(name, tuple(array.shape), array.dtype, raw, lambda: array)


def hparams_metadata(cfg: dict, arch: str = "llama") -> dict:
    """A config.json's hyperparameters as llama.cpp's metadata ({key: (GGUFWriter add_* kind, value)})."""
    a, heads = f"{arch}.", cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = {a + "block_count": ("uint32", cfg["num_hidden_layers"]),
          a + "context_length": ("uint32", cfg["max_position_embeddings"]),
          a + "embedding_length": ("uint32", cfg["hidden_size"]),
          a + "feed_forward_length": ("uint32", cfg["intermediate_size"]),
          a + "attention.head_count": ("uint32", heads),
          a + "attention.head_count_kv": ("uint32", cfg.get("num_key_value_heads", heads)),
          a + "rope.freq_base": ("float32", cfg.get("rope_theta", 10000.0)),
          a + "attention.layer_norm_rms_epsilon": ("float32", cfg["rms_norm_eps"]),
          a + "vocab_size": ("uint32", cfg["vocab_size"]), a + "rope.dimension_count": ("uint32", head_dim)}
    if head_dim != cfg["hidden_size"] // heads:
        kv.update({a + "attention.key_length": ("uint32", head_dim), a + "attention.value_length": ("uint32", head_dim)})
    return kv


def vocab_metadata(tokens: list[str], types: list[int], merges: list[str] | None, special: dict[str, int], *,
                   pre: str, add_bos: bool, chat_template: str | None) -> dict:
    """A vocabulary as llama.cpp's metadata: byte-level BPE ("gpt2": tokens, types, merges, pre),
    or, merges None, a sentencepiece one (the caller adds its scores). special: {"bos": id, ...}."""
    kv = {"tokenizer.ggml.model": ("string", "llama" if merges is None else "gpt2"),
          "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type": ("array", types),
          **{f"tokenizer.ggml.{key}_token_id": ("uint32", int(i)) for key, i in special.items()},
          "tokenizer.ggml.add_bos_token": ("bool", add_bos)}
    if merges is not None:
        kv.update({"tokenizer.ggml.pre": ("string", pre), "tokenizer.ggml.merges": ("array", merges)})
    if chat_template is not None:
        kv["tokenizer.chat_template"] = ("string", chat_template)
    return kv


def bpe_vocab(tokenizer: dict, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a byte-level BPE tokenizer.json as llama.cpp's converter stores
    them: one token per id below vocab_size, added tokens control (special) or user-defined, ids
    the tokenizer lacks filled with unused "[PAD<id>]" tokens."""
    tokens: list[str | None] = [None] * vocab_size
    types = [NORMAL] * vocab_size
    for token, i in tokenizer["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i] = token
    for added in tokenizer.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    for i in (i for i, t in enumerate(tokens) if t is None):
        tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    return tokens, types, merges


def write_gguf_file(path: str | Path, arch: str, kv: dict, tensors: list[TensorEntry]) -> Path:
    """Write the file: general.architecture, then `kv` ({key: (kind, value)}, kind a GGUFWriter
    add_* suffix such as "uint32"), then the tensors in order, each made when its turn comes."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in kv.items():
        getattr(w, f"add_{kind}")(key, list(value) if kind == "array" else value)
    total = sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in tensors)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, t.dtype, int(np.prod(t.shape)) * t.dtype.itemsize, raw_dtype=t.raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = last = time.perf_counter()
    done = 0
    for i, t in enumerate(tensors, 1):
        array = t.make()
        if array.shape != t.shape or array.dtype != t.dtype:
            raise ValueError(f"{t.name}: made {array.dtype} {array.shape}, planned {t.dtype} {t.shape}")
        w.write_tensor_data(array)
        done += array.nbytes
        if time.perf_counter() - last >= PROGRESS_SECONDS:
            last = time.perf_counter()
            log.info("%s: %d of %d tensors, %.0f of %.0f MB (%.0f s)", Path(path).name, i, len(tensors),
                     done / 1e6, total / 1e6, last - start)
    w.close()
    return Path(path)

