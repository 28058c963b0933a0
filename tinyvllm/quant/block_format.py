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
linear_dequantized() then multiplies bf16 activations by those bf16 weights with float32
accumulation: prefill's dequantize-then-GEMM, and the decode GEMV of Q8_0, Q6_K and mixed groups.
The decode GEMV of the nibble formats (Q4_0, Q4_1, Q4_K) rounds no weight: it factors each
32-weight block's affine map w = a * c + b out of the dot product (linear_factored), so its result
is the exact product up to float32 roundings (factored_error_bound). linear() picks the twin of
the path the GPU takes for a batch of m rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from tinyvllm.errors import ModelLoadError

BF16 = np.dtype(ml_dtypes.bfloat16)
NO_MIN = np.float32(-0.0)        # a format's b where it has no min: a * q + b is then a * q, zero's sign kept


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: `block_elements` consecutive weights of a row stored in
    `block_bytes` bytes. `fp16_fields` are the byte offsets of the block's fp16 fields (scales
    and mins), checked for finiteness at load. `fields` reads [n, block_bytes] uint8 blocks as
    their integer form, the one place that knows the block's bytes: (q int8 [n, S, E], a and b
    float32 [n, S]) for its S sub-blocks of E weights, each weight exactly fl32(a * q + b) (step
    2 of the module docstring: a * q exact; b the min, or -0 where the format has none, so that
    a * q + b is a * q with zero's sign kept). decode(), the GEMV's EXPANDED upload
    (gpu/quant_weights.py) and llama.cpp's twin read blocks through it. `nibble_offset` marks the
    nibble formats, whose decode GEMV factors (linear_factored): q = c - nibble_offset for the
    4-bit code c."""
    name: str
    block_elements: int
    block_bytes: int
    fp16_fields: tuple[int, ...]
    fields: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    nibble_offset: int | None = None

    def decode(self, blocks: np.ndarray) -> np.ndarray:
        """[n, block_bytes] uint8 -> [n, block_elements] float32: fl32(a * q + b) per weight."""
        q, a, b = self.fields(blocks)
        return (a[:, :, None] * q.astype(np.float32) + b[:, :, None]).reshape(len(blocks), self.block_elements)

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

    def fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The whole matrix's integer form, its blocks in row order (BlockFormat.fields)."""
        return self.format.fields(self.format.blocks(self.blocks, self.shape))

    def dequantize_bf16(self) -> np.ndarray:
        return self.format.dequantize_bf16(self.blocks, self.shape)


# the quantized decode GEMV's largest batch (gpu/ops/quant_gemv.py takes it from here): linear() at
# m <= this is the GEMV's twin, above it prefill's dequantize-then-GEMM twin
GEMV_MAX_ROWS = 8
CODE_BIAS = 128                          # the GEMV feeds code c as the bf16 value 128 + c (exact)


def linear(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """Y[m, n] = X[m, k] . W[n, k] in float32: the twin of the GPU path that runs it. m <= 8 on
    a nibble format is the decode GEMV's factored product (linear_factored); anything else
    dequantizes (linear_dequantized: prefill's dequantize-then-GEMM, and the GEMV of the other
    formats, which rounds each weight to bf16 in registers)."""
    if np.ndim(x) == 2 and np.shape(x)[0] <= GEMV_MAX_ROWS and weight.format.nibble_offset is not None:
        return linear_factored(x, weight)
    return linear_dequantized(x, weight)


def linear_dequantized(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """Y[m, n] = bf16(X)[m, k] @ W_bf16[n, k]^T in float32. X is rounded to bf16 (the activations
    live in bf16 on the GPU), W is dequantized as the module docstring states (one float32 value,
    one bf16 rounding), the products of two bf16 values are exact in float32 and summed in float32."""
    return bf16_as_f32(np.asarray(x, np.float32).astype(BF16)) @ bf16_as_f32(weight.dequantize_bf16()).T


def affine_blocks(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A nibble-format weight as 32-weight blocks w = a * c + b of its 4-bit codes c (its format's
    fields with q = c - nibble_offset): (codes uint8 [n, nb, 32], a and b float32 [n, nb]), nb =
    k / 32, each weight exactly a * c + b.
    Q4_0: (d, -8 d); Q4_1: (d, m); Q4_K per sub-block: (d * sc, -(dmin * mn)); all exact in float32."""
    n, k = weight.shape
    fmt = weight.format
    if fmt.nibble_offset is None:
        raise ValueError(f"{fmt.name}: not a nibble format, the only ones the GEMV factors")
    q, a, b = weight.fields()
    codes = (q.astype(np.int16) + fmt.nibble_offset).astype(np.uint8)
    b = b - np.float32(fmt.nibble_offset) * a          # a * (c - off) + b = a * c + (b - off * a); off * a exact
    return codes.reshape(n, k // 32, 32), a.reshape(n, -1), b.reshape(n, -1)


def linear_factored(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """Y[m, n] in float32 as the decode GEMV (cuda/gemv_quant.cu) computes a nibble format:
    with the block's affine map factored out of the dot product, never rounding a weight.
    Per 32-weight block (w = a * c + b, affine_blocks):
        P = fl32(sum (128 + c) * x)       the tensor cores' sum; each product is exact (8 x 8 bits)
        S = fl32(sum x)                   the block's sum of bf16(X)
        bias = fl32(b - 128 * a)          (128 * a exact; Q4_0's -136 * d exact too)
        Y += a * P + bias * S             over the blocks, in float32
    so sum w * x = a * sum c x + b * sum x holds up to float32 roundings only (factored_error_bound),
    where the dequantizing formula rounds every weight to bf16 (2^-9 of |w| each)."""
    xb = bf16_as_f32(np.asarray(x, np.float32).astype(BF16))
    codes, a, b = affine_blocks(weight)
    m, nb = xb.shape[0], codes.shape[1]
    xblocks = xb.reshape(m, nb, 32)
    biased = codes.astype(np.float32) + np.float32(CODE_BIAS)
    p = np.einsum("nbk,mbk->mnb", biased, xblocks, dtype=np.float32)
    s = xblocks.sum(axis=2, dtype=np.float32)                              # [m, nb]
    bias = (b - np.float32(CODE_BIAS) * a).astype(np.float32)
    return (np.einsum("nb,mnb->mn", a, p, dtype=np.float32)
            + np.einsum("nb,mb->mn", bias, s, dtype=np.float32)).astype(np.float32)


def factored_error_bound(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """float64 [m, n]: a bound on |Y - E| for Y any float32 evaluation of linear_factored's formula
    (any order of its sums: the twin's, or the kernel's MMA fragments, k-split and fold) and E the
    exact sum_k w_k * bf16(x_k) (w the exact block value a * c + b).
    Every rounded quantity along the way is a partial sum of the terms
        |a| (128 + c_k) |x_k|   and   |bias| |x_k|          (M: their total over k)
    and each result passes through at most L = 31 (a block's P or S) + 1 (bias, the products a * P
    and bias * S) + 2 nb (the fold over nb blocks) + 16 (the k-split's partial tiles) + 2 roundings,
    each at most u of a value at most M: |Y - E| <= L u M (1 + L u). u = 2^-23, twice float32's
    unit roundoff, covers the tensor cores' adds, which truncate instead of rounding to nearest.
    Two such evaluations (the kernel and its twin) differ by at most twice this."""
    xb = np.abs(bf16_as_f32(np.asarray(x, np.float32).astype(BF16)).astype(np.float64))
    codes, a, b = affine_blocks(weight)
    m, nb = xb.shape[0], codes.shape[1]
    xblocks = xb.reshape(m, nb, 32)
    bias = np.abs((b - np.float32(CODE_BIAS) * a).astype(np.float64))
    total = (np.einsum("nb,nbk,mbk->mn", np.abs(a.astype(np.float64)), codes + float(CODE_BIAS), xblocks)
             + np.einsum("nb,mb->mn", bias, xblocks.sum(axis=2)))
    steps = 31 + 1 + 2 * nb + 16 + 2
    u = 2.0 ** -23
    return steps * u * total * (1 + steps * u)


def bf16_as_f32(a: np.ndarray) -> np.ndarray:
    """bf16 -> float32, exactly (a bf16 value is the top half of its float32): a shift of the
    bits, much faster than ml_dtypes' element-wise cast."""
    return (np.asarray(a, BF16).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- field readers shared by the formats ------------------------------------------------------

def fp16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 field at `offset` of every block, widened exactly: [n, 1] float32."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def low_then_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, b] bytes -> [n, 2b] values 0..15: the b low nibbles in byte order, then the b high
    nibbles (byte j holds element j and element j + b)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)
