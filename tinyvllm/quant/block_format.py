"""What every GGUF block format shares: the frozen description of a block, a quantized weight
(the raw blocks of one matrix), dequantization to float32 and to bf16, and the quantized linear.

A GGUF matrix of `rows` x `cols` weights (rows = output features, as Hugging Face stores a
linear layer's weight) is stored row by row; each row is cols / block_elements blocks of
block_bytes bytes, in the order of the row's weights. So the raw bytes are a uint8 array
[rows, (cols / block_elements) * block_bytes], and a row permutation of the matrix is the same
permutation of the raw rows (llama.cpp's q/k row order can be undone on the blocks).

Rounding, as the dequantizing decode GEMV will do it in registers (gguf_legacy.py and
gguf_kquants.py give each format's formula):
  1. Every block field becomes float32 exactly: fp16 scales and mins by widening, the small
     integers (4-, 6- and 8-bit quants, 6-bit sub-block scales, int8 sub-block scales) as they are.
  2. The products scale * quant are exact in float32 (at most 23 significant bits: an fp16 scale
     has 11, a sub-block scale at most 7, a quant at most 5 beyond a power of two). Only a
     format with a min (Q4_1, Q4_K) adds one float32 rounding: fl32(scale * q + min), the value
     one fmaf gives (the product being exact, a separate multiply and add give the same value).
     This float32 value equals the `gguf` package's dequantization bit for bit.
  3. One bf16 rounding (nearest even) of that float32 value: the weight the tensor cores read.
     No bf16 subnormal occurs: every dequantized value is 0 or a multiple of 2^-24 (the fp16
     quantum), far above bf16's 2^-126.
linear() then multiplies bf16 activations by those bf16 weights with float32 accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from tinyvllm.errors import ModelLoadError

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: `block_elements` consecutive weights of a row stored in
    `block_bytes` bytes. `fp16_fields` are the byte offsets of the block's fp16 fields (scales
    and mins), checked for finiteness at load. `decode` turns [n, block_bytes] uint8 blocks into
    [n, block_elements] float32 values (step 2 of the module docstring), vectorised over blocks."""
    name: str
    block_elements: int
    block_bytes: int
    fp16_fields: tuple[int, ...]
    decode: Callable[[np.ndarray], np.ndarray]

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_elements * self.block_bytes

    def blocks(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """raw bytes of a [rows, cols] matrix -> [rows * cols / block_elements, block_bytes]."""
        rows, cols = shape
        if cols % self.block_elements:
            raise ValueError(f"{self.name}: a row of {cols} weights is not whole blocks of {self.block_elements}")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != rows * self.row_bytes(cols):
            raise ValueError(f"{self.name}: {rows}x{cols} weights take {rows * self.row_bytes(cols)} "
                             f"bytes; got {raw.dtype}[{raw.size}]")
        return raw.reshape(-1, self.block_bytes)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """float32 [rows, cols]: the exact block formula with at most one float32 rounding."""
        return self.decode(self.blocks(raw, shape)).reshape(shape)

    def dequantize_bf16(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """bf16 [rows, cols]: the float32 dequantization rounded once to bf16 (nearest even),
        the weight the dequantizing GEMV feeds to the tensor cores."""
        return self.dequantize(raw, shape).astype(BF16)

    def fp16_scales(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """[blocks, len(fp16_fields)] float16: every block's fp16 fields."""
        blocks = self.blocks(raw, shape)
        return np.stack([fp16_at(blocks, offset)[:, 0] for offset in self.fp16_fields], axis=1).astype(np.float16)


@dataclass(frozen=True, eq=False)         # arrays: compared by identity
class QuantizedWeight:
    """One matrix kept as its blocks: `blocks` is uint8 [rows, row_bytes] (a view of the file
    where it came from one); `shape` is (rows, cols) in Hugging Face order."""
    format: BlockFormat
    shape: tuple[int, int]
    blocks: np.ndarray

    @classmethod
    def from_raw(cls, fmt: BlockFormat, shape: tuple[int, int], raw: np.ndarray, name: str,
                 source: str = "") -> QuantizedWeight:
        """Checks size and scale finiteness; a bad tensor is one ModelLoadError naming it (and
        the file, `source`)."""
        rows, cols = (int(d) for d in shape)
        where = f"{source}: tensor {name!r}" if source else f"tensor {name!r}"
        if cols % fmt.block_elements:
            raise ModelLoadError(f"{where}: {fmt.name} rows of {cols} weights are not whole "
                                 f"blocks of {fmt.block_elements}")
        raw = np.asarray(raw)
        need = rows * fmt.row_bytes(cols)
        if raw.dtype != np.uint8 or raw.size != need:
            raise ModelLoadError(f"{where}: {fmt.name} {rows}x{cols} takes {need} bytes, "
                                 f"the file holds {raw.size}")
        scales = fmt.fp16_scales(raw, (rows, cols))
        if not np.isfinite(scales).all():
            block = int(np.argwhere(~np.isfinite(scales))[0][0])
            raise ModelLoadError(f"{where}: {fmt.name} block {block} has a non-finite scale or min")
        return cls(fmt, (rows, cols), raw.reshape(rows, fmt.row_bytes(cols)))

    @property
    def nbytes(self) -> int:
        return self.blocks.size

    def dequantize(self) -> np.ndarray:
        return self.format.dequantize(self.blocks, self.shape)

    def dequantize_bf16(self) -> np.ndarray:
        return self.format.dequantize_bf16(self.blocks, self.shape)


def linear(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """Y[m, n] = bf16(X)[m, k] @ W_bf16[n, k]^T in float32: the twin of the dequantizing GEMV.
    X is rounded to bf16 (the activations live in bf16 on the GPU), W is dequantized as the
    module docstring states (one float32 value, one bf16 rounding), the products of two bf16
    values are exact in float32 and summed in float32."""
    x32 = np.asarray(x, np.float32).astype(BF16).astype(np.float32)
    return x32 @ weight.dequantize_bf16().astype(np.float32).T


# ---- field readers shared by the formats ------------------------------------------------------

def fp16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 field at `offset` of every block, widened exactly: [n, 1] float32."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def low_then_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, b] bytes -> [n, 2b] values 0..15: the b low nibbles in byte order, then the b high
    nibbles (byte j holds element j and element j + b)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)
