"""GGUF's 256-weight "K" super-blocks: Q4_K and Q6_K (llama.cpp's Q4_K_M files mix the two).

A super-block covers 256 consecutive weights of a row and splits them into sub-blocks, each with
its own small integer scale (and for Q4_K a min), themselves scaled by the super-block's fp16
factors. All fields are little-endian.

Q4_K, 144 bytes, 8 sub-blocks of 32 weights:
    [0:2]    d     fp16, scale of the sub-block scales
    [2:4]    dmin  fp16, scale of the sub-block mins
    [4:16]   12 bytes: eight 6-bit scales sc[0..7] and eight 6-bit mins mn[0..7], packed as
             bytes s[0..11]:  for j < 4:  sc[j] = s[j] & 63,        mn[j] = s[j + 4] & 63
                              for j >= 4: sc[j] = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4
                                          mn[j] = (s[j + 4] >> 4) | (s[j] >> 6) << 4
    [16:144] 128 bytes of 4-bit codes, four runs of 32 bytes: run r holds sub-block 2r in its
             bytes' low nibbles and sub-block 2r + 1 in their high nibbles (byte i of the run:
             weight i of each)
    w = (d * sc[j]) * c - dmin * mn[j]          (codes 0..15; j the weight's sub-block)

Q6_K, 210 bytes, 16 sub-blocks of 16 weights:
    [0:128]   ql: low 4 bits of the 6-bit codes
    [128:192] qh: high 2 bits of the 6-bit codes
    [192:208] sc[0..15] int8 sub-block scales
    [208:210] d fp16
    The 256 weights are two halves of 128; half h uses ql[64h:64h+64] and qh[32h:32h+32]. Weight
    e = 32 * quarter + i of a half (quarter 0..3, i 0..31) takes its low bits from ql byte i
    (quarters 0, 2) or i + 32 (quarters 1, 3), low nibble in quarters 0, 1 and high nibble in
    2, 3, and its high bits from qh byte i, bits 2 * quarter and 2 * quarter + 1.
    w = (d * sc[e // 16 of the whole block]) * (c - 32)           (codes 0..63 -> -32..31)

In float32 (block_format.py's steps): d * sc is exact (11 + 7 bits), so is its product with a
code (at most 23 bits) and dmin * mn; Q6_K's value is exact, Q4_K's difference rounds once
(one fmaf(d * sc, c, -(dmin * mn)) on the GPU). bf16 rounding follows, once.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.quant.block_format import NO_MIN, BlockFormat, fp16_at

SUPER_BLOCK = 256


def q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] bytes -> ([n, 8], [n, 8]) uint8: the 6-bit sub-block scales and mins."""
    first, second, low_nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & 63, (low_nibbles & 15) | ((first >> 6) << 4)], axis=1)
    mins = np.concatenate([second & 63, (low_nibbles >> 4) | ((second >> 6) << 4)], axis=1)
    return scales, mins


def q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, 144] blocks -> (codes uint8 [n, 8, 32], step = d * sc and offset = dmin * mn float32
    [n, 8], both exact): sub-block j's weights are step[j] * codes[j] - offset[j]."""
    n = len(blocks)
    d, dmin = fp16_at(blocks, 0), fp16_at(blocks, 2)
    scales, mins = q4_k_scales_and_mins(blocks[:, 4:16])
    runs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    codes = np.concatenate([runs & 15, runs >> 4], axis=2).reshape(n, 8, 32)
    return codes, d * scales.astype(np.float32), dmin * mins.astype(np.float32)


def q6_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 210] blocks -> (quants int8 [n, 16, 16] = code - 32, step = d * sc float32 [n, 16],
    exact): sub-block j's weights are step[j] * quants[j]."""
    n = len(blocks)
    low_bytes = blocks[:, 0:128].reshape(n, 2, 1, 2, 32)      # [half, nibble, run, i]
    low = np.concatenate([low_bytes & 15, low_bytes >> 4], axis=2).reshape(n, 2, 4, 32)
    high_bytes = blocks[:, 128:192].reshape(n, 2, 1, 32)      # [half, quarter, i]
    high = (high_bytes >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    quants = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 16, 16)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return quants, fp16_at(blocks, 208) * scales


def _fields_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes, step, offset = q4_k_fields(blocks)
    return codes.astype(np.int8), step, -offset          # step * code exact: adding -offset rounds once


def _fields_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    quants, step = q6_k_fields(blocks)
    return quants, step, np.full_like(step, NO_MIN)     # step * quant exact: no min


Q4_K = BlockFormat("Q4_K", SUPER_BLOCK, 144, fp16_fields=(0, 2), fields=_fields_q4_k, nibble_offset=0)
Q6_K = BlockFormat("Q6_K", SUPER_BLOCK, 210, fp16_fields=(208,), fields=_fields_q6_k)
