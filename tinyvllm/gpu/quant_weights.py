"""Quantized weights on the GPU: which kinds the CUDA kernels read, how each is laid out for them,
and the device handle the model passes to linear() in a bf16 pointer's place.

cuda/gemv_quant.cu's header has the layouts; in short, a matrix W [rows, cols] becomes two planes:

    FP8       codes  uint8 [rows, cols] (e4m3 bytes as stored)  | scales float32 [rows]
    Q8_0      quants int8  [rows, nb * 32]                       | d fp16 [rows, nb rounded up to even]
    Q4_0      quants uint8 [rows, nb * 16] (the packed nibbles)  | d fp16 [rows, nb rounded up to even]
    Q4_1      quants uint8 [rows, nb * 16]                       | (d, m) fp16 pairs [rows, nb]
    Q4_K      quants uint8 [rows, nb * 16] (Q4_0's nibble order) | (d * sc, -(dmin * mn)) fp32 pairs [rows, nb]
    Q6_K      quants int8  [rows, cols] (code - 32)              | d * sc fp32 [rows, cols / 16]
    EXPANDED  quants int8  [rows, cols]                          | (a, b) fp32 pairs [rows, cols / 16]

(nb = cols / 32 blocks or sub-blocks a row). A legacy block's fields are split, not changed: the
quants plane holds each block's quant bytes in place, 16-byte aligned per row so a lane's 16-byte
copy is one aligned load (a 20-byte Q4_1 block never is), and the scales plane its fp16 fields;
the padding of an odd nb (Q8_0, Q4_0) is 2 bytes a row. FP8 per-tensor scales are repeated per row.
The K-quants' sub-block scales are pre-multiplied at upload into fp32 (exact: quant/gguf_kquants.py),
so a lane reads one scale entry and the value is one fmaf as in Q4_1: Q4_K's nibbles repacked per
32-weight sub-block (6 bits a weight on the device against the file's 4.5), Q6_K's 6-bit codes
widened to a byte (10 bits against 6.56). EXPANDED is a fused group whose parts are blocks of
different formats (a Q4_K_M file's q/k/v with v in Q6_K): every part's weights as w = fmaf(a, q, b)
per 16 (12 bits a weight) so the group stays one matrix and the fused qkv + RoPE + KV-write
epilogue runs on it; every GGUF format's value is that one fmaf exactly (expanded_fields).

planes_dequantize_bf16() reads the planes as the kernels do, in numpy: the CPU tests hold the
packing to each format's twin (QuantizedWeight.dequantize_bf16, Fp8Weight.dequantize) with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.block_format import BF16, QuantizedWeight, bf16_as_f32
from tinyvllm.quant.fp8 import E4M3, Fp8Weight
from tinyvllm.quant.gguf_kquants import q4_k_fields, q6_k_fields
from tinyvllm.quant.weight_kinds import GPU_KINDS, RowStack, kind_name

FP8_COL_MULTIPLE, BLOCK = 16, 32                  # a lane's 16 codes; a GGUF block
EXPANDED_GROUP = 16                               # weights per (a, b) pair: a lane's 16 bytes
EXPANDED = "EXPANDED"                             # the device kind of a fused group of mixed formats


@dataclass(frozen=True)
class QuantMatrix:
    """A quantized [rows, cols] matrix on the device: its kind (GPU_KINDS), the two planes'
    pointers and their bytes (the module docstring's layout)."""
    kind: str
    data: int
    scales: int
    rows: int
    cols: int
    nbytes: int


def _scale_words(rows: int, nb: int, fields: np.ndarray) -> np.ndarray:
    """fp16 d fields [rows, nb, 2] bytes -> [rows, nb rounded up to even] fp16 (zero padded), as bytes."""
    padded = np.zeros((rows, nb + nb % 2, 2), np.uint8)
    padded[:, :nb] = fields
    return padded.reshape(rows, -1)


def pack_planes(weight) -> tuple[str, np.ndarray, np.ndarray]:
    """(device kind, quants plane bytes, scales plane bytes) of an Fp8Weight, a QuantizedWeight in
    a GPU kind, or a RowStack of GGUF blocks (EXPANDED); anything else is a ModelLoadError naming
    its kind."""
    kind = kind_name(weight)
    if isinstance(weight, RowStack):
        if not all(isinstance(p, QuantizedWeight) and p.format.name in GPU_KINDS for p in weight.parts):
            raise ModelLoadError(f"the CUDA kernels read fused groups of GGUF blocks, not {kind}")
        fields = [expanded_fields(p) for p in weight.parts]
        q, a, b = (np.concatenate([f[i] for f in fields], axis=0) for i in range(3))
        return EXPANDED, q.view(np.uint8), np.stack([a, b], axis=-1).reshape(len(q), -1).view(np.uint8)
    if kind not in GPU_KINDS:
        raise ModelLoadError(f"the CUDA kernels read {', '.join(GPU_KINDS)} weights, not {kind}")
    rows, cols = weight.shape
    if isinstance(weight, Fp8Weight):
        if cols % FP8_COL_MULTIPLE:
            raise ModelLoadError(f"an FP8 matrix of {cols} columns: the FP8 GEMV needs a multiple of {FP8_COL_MULTIPLE}")
        return kind, np.ascontiguousarray(weight.codes).view(np.uint8), np.ascontiguousarray(weight.row_scales(), np.float32)
    if kind == "Q4_K":
        codes, step, offset = q4_k_fields(_blocks(weight))
        codes = codes.reshape(rows, cols // BLOCK, BLOCK)
        nibbles = codes[:, :, :16] | (codes[:, :, 16:] << 4)         # Q4_0's order: c[j] | c[j + 16] << 4
        pairs = np.stack([step, -offset], axis=-1).reshape(rows, -1)  # -offset: exact (a zero becomes -0)
        return kind, nibbles.reshape(rows, -1), pairs.view(np.uint8)
    if kind == "Q6_K":
        quants, step = q6_k_fields(_blocks(weight))
        return kind, quants.reshape(rows, cols).view(np.uint8), step.reshape(rows, -1).view(np.uint8)
    nb = cols // BLOCK
    blocks = np.asarray(weight.blocks, np.uint8).reshape(rows, nb, weight.format.block_bytes)
    if kind == "Q4_1":
        return kind, blocks[:, :, 4:].reshape(rows, -1).copy(), blocks[:, :, :4].reshape(rows, -1).copy()
    return kind, blocks[:, :, 2:].reshape(rows, -1).copy(), _scale_words(rows, nb, blocks[:, :, :2])


def _blocks(weight: QuantizedWeight) -> np.ndarray:
    """[blocks, block_bytes] uint8: the weight's blocks in row order."""
    return np.asarray(weight.blocks, np.uint8).reshape(-1, weight.format.block_bytes)


def expanded_fields(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [rows, cols], a, b float32 [rows, cols / 16]): a GGUF matrix as w = fl32(a * q + b)
    per 16 weights, each value its format's twin's exactly: a * q is exact in every format (the
    twins' step 2); b = -0 where the format has no min, so a * q + b is a * q, zero's sign kept."""
    rows, cols = weight.shape
    q, a, b = weight.fields()                             # the format's integer form (block_format.py)
    per_entry = q.size // a.size // EXPANDED_GROUP      # a K-quant's sub-block or a block: 1 or 2 groups of 16
    a, b = (np.repeat(v.reshape(-1), per_entry) for v in (a, b))
    return q.reshape(rows, cols), a.reshape(rows, -1).astype(np.float32), b.reshape(rows, -1).astype(np.float32)


def planes_dequantize_bf16(kind: str, quants: np.ndarray, scales: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """bf16 [rows, cols]: the planes read back as the GEMV's registers hold them (the GGUF kinds'
    values; FP8's codes times 1 — the GEMV scales its sum, fp8_scaled_bf16 says what prefill reads)."""
    quants = np.asarray(quants, np.uint8).reshape(rows, -1)
    if kind == "FP8":
        return quants.view(E4M3).astype(np.float32).astype(BF16)
    if kind in ("Q6_K", EXPANDED):
        q = quants.view(np.int8).astype(np.float32).reshape(rows, cols // EXPANDED_GROUP, EXPANDED_GROUP)
        f32 = np.asarray(scales, np.uint8).reshape(rows, -1).view(np.float32)
        if kind == "Q6_K":
            return (f32[:, :, None] * q).reshape(rows, cols).astype(BF16)
        a, b = f32[:, 0::2, None], f32[:, 1::2, None]
        return np.float32(a * q + b).reshape(rows, cols).astype(BF16)   # a * q exact: one rounding (fmaf)
    nb = cols // BLOCK
    halves = np.asarray(scales, np.uint8).reshape(rows, -1).view("<f2").astype(np.float32)
    if kind == "Q8_0":
        q = quants.view(np.int8).astype(np.float32).reshape(rows, nb, BLOCK)
        return (halves[:, :nb, None] * q).reshape(rows, cols).astype(BF16)
    nibbles = quants.reshape(rows, nb, 16)
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=2).astype(np.float32)
    if kind == "Q4_K":
        pairs = np.asarray(scales, np.uint8).reshape(rows, -1).view(np.float32)
        return np.float32(pairs[:, 0::2, None] * codes + pairs[:, 1::2, None]).reshape(rows, cols).astype(BF16)
    if kind == "Q4_0":
        return (halves[:, :nb, None] * (codes - np.float32(8))).reshape(rows, cols).astype(BF16)
    d, m = halves[:, 0::2, None], halves[:, 1::2, None]
    return np.float32(d * codes + m).reshape(rows, cols).astype(BF16)   # d * c exact: one rounding (fmaf)


def fp8_scaled_bf16(quants: np.ndarray, scales: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """bf16 [rows, cols] = bf16(code * scale[row]): what the FP8 dequantization kernel writes for
    prefill's cuBLAS GEMM (Fp8Weight.dequantize() rounded once to bf16)."""
    codes = bf16_as_f32(planes_dequantize_bf16("FP8", quants, scales, rows, cols))
    return (codes * np.asarray(scales, np.float32).reshape(rows, 1)).astype(BF16)


def dequantized_table(weight) -> np.ndarray:
    """bf16 [rows, cols] of a quantized embedding table, for the embedding gather (each row as
    weight_kinds.embedding_rows gives it, rounded once to bf16: the value the residual stream gets)."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize_bf16()
    if isinstance(weight, Fp8Weight):
        return weight.dequantize().astype(BF16)
    raise ModelLoadError(f"an embedding table of kind {kind_name(weight)} has no GPU gather")
