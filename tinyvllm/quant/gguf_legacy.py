"""GGUF's 32-weight blocks: Q8_0, Q4_0 and Q4_1 (llama.cpp's first formats; the default model,
SmolLM2-135M-Instruct.Q4_1.gguf, stores its embedding as Q8_0 and every layer matrix as Q4_1).

Each block covers 32 consecutive weights of a row. All fields are little-endian; d is the block's
scale, m its min, both IEEE fp16:

    Q8_0, 34 bytes:  [0:2] d fp16 | [2:34] q[0..31] int8
                     w[i] = d * q[i]
    Q4_0, 18 bytes:  [0:2] d fp16 | [2:18] 16 bytes of packed 4-bit codes
                     byte j holds code c[j] in its low nibble and c[j + 16] in its high nibble
                     w[i] = d * (c[i] - 8)                      (codes 0..15 -> -8..7)
    Q4_1, 20 bytes:  [0:2] d fp16 | [2:4] m fp16 | [4:20] packed 4-bit codes, as Q4_0
                     w[i] = d * c[i] + m                        (codes 0..15, no offset)

In float32 (block_format.py's steps): d * q and d * (c - 8) are exact (11 + 8 significant bits at
most) and are the dequantized value; Q4_1's d * c is exact too and the one rounding is the sum
fl32(d * c + m) (one fmaf on the GPU). bf16 rounding follows, once.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.quant.block_format import NO_MIN, BlockFormat, fp16_at, low_then_high_nibbles

BLOCK = 32


def _fields_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = fp16_at(blocks, 0)
    return np.ascontiguousarray(blocks[:, 2:34]).view(np.int8)[:, None, :], d, np.full_like(d, NO_MIN)


def _fields_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = fp16_at(blocks, 0)
    q = low_then_high_nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return q[:, None, :], d, np.full_like(d, NO_MIN)


def _fields_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # d * c is exact: the sum with m rounds once
    return low_then_high_nibbles(blocks[:, 4:20]).astype(np.int8)[:, None, :], fp16_at(blocks, 0), fp16_at(blocks, 2)


Q8_0 = BlockFormat("Q8_0", BLOCK, 34, fp16_fields=(0,), fields=_fields_q8_0)
Q4_0 = BlockFormat("Q4_0", BLOCK, 18, fp16_fields=(0,), fields=_fields_q4_0, nibble_offset=8)
Q4_1 = BlockFormat("Q4_1", BLOCK, 20, fp16_fields=(0, 2), fields=_fields_q4_1, nibble_offset=0)
