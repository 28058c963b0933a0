"""A GGUF file's tensors as they are stored: block-quantized matrices as QuantizedWeight (a view
of the memory-mapped blocks, nothing dequantized), float tensors as arrays.

The file is opened through gguf_header.py (every count and offset checked first) and
read with the `gguf` package's GGUFReader, whose tensors carry `tensor_type`, `shape` (ggml order:
innermost dimension first, so a [rows, cols] matrix is listed as [cols, rows]) and `data` (for a
block type: uint8 [rows, row_bytes]). Names stay llama.cpp's (blk.N.attn_q.weight, ...); mapping
them to Hugging Face names and undoing llama.cpp's q/k row order (a permutation of whole rows, so
of whole block rows too) is gguf.py's. The block formats are quant/'s (weight_kinds.BLOCK_FORMATS).
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint.gguf_header import open_gguf
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import QuantizedWeight
from tinyvllm.quant.weight_kinds import BLOCK_FORMATS

FLOAT_TYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
               "BF16": np.dtype(ml_dtypes.bfloat16)}


def hf_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's dimensions in numpy / Hugging Face order (outermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def tensor_weight(tensor, source: str) -> QuantizedWeight | np.ndarray:
    """One GGUFReader tensor: a QuantizedWeight for a block type, an array for F32/F16/BF16.
    Any other type, or a block type on a tensor that is not a matrix, is a ModelLoadError."""
    kind = tensor.tensor_type.name
    shape = hf_shape(tensor)
    if kind in FLOAT_TYPES:
        data = np.asarray(tensor.data)
        if kind == "BF16":                     # the reader hands BF16 out as its raw bytes
            data = data.view(FLOAT_TYPES[kind])
        return data.reshape(shape)
    if kind not in BLOCK_FORMATS:
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} has type {kind}; tinyvllm keeps "
                             f"{', '.join(BLOCK_FORMATS)} blocks and reads {', '.join(FLOAT_TYPES)}")
    if len(shape) != 2:
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} is {kind} with shape {shape}; "
                             "block-quantized tensors must be matrices")
    return QuantizedWeight.from_raw(BLOCK_FORMATS[kind], shape, np.asarray(tensor.data), tensor.name,
                                 source)


def read_gguf_weights(path: str | Path) -> dict[str, QuantizedWeight | np.ndarray]:
    """Every tensor of a GGUF file under its llama.cpp name, kept in its stored precision."""
    reader = open_gguf(path)
    return {t.name: tensor_weight(t, str(path)) for t in reader.tensors}
