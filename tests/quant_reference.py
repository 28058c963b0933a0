"""Exact float64 dequantization of one GGUF block at a time, written element by element from the
block layouts (llama.cpp's dequantize_row_* loops, in Python): a second, deliberately plain
reading of the formats, and the exact values the float32/bf16 twins are bounded against. Every
value is exact in float64: fp16 fields times small integers have at most 45 significant bits."""
from __future__ import annotations

import struct

import numpy as np


def _fp16(block: bytes, offset: int) -> float:
    return struct.unpack_from("<e", block, offset)[0]


def q8_0(block: bytes) -> list[float]:
    d = _fp16(block, 0)
    return [d * struct.unpack_from("<b", block, 2 + i)[0] for i in range(32)]


def q4_0(block: bytes) -> list[float]:
    d, out = _fp16(block, 0), [0.0] * 32
    for j in range(16):
        out[j] = d * ((block[2 + j] & 0x0F) - 8)
        out[j + 16] = d * ((block[2 + j] >> 4) - 8)
    return out


def q4_1(block: bytes) -> list[float]:
    d, m, out = _fp16(block, 0), _fp16(block, 2), [0.0] * 32
    for j in range(16):
        out[j] = d * (block[4 + j] & 0x0F) + m
        out[j + 16] = d * (block[4 + j] >> 4) + m
    return out


def _q4_k_scale_min(j: int, s: bytes) -> tuple[int, int]:
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def q4_k(block: bytes) -> list[float]:
    d, dmin = _fp16(block, 0), _fp16(block, 2)
    scales, qs, out = block[4:16], block[16:144], []
    for run in range(4):                         # 32 bytes -> sub-blocks 2 run and 2 run + 1
        sc, mn = _q4_k_scale_min(2 * run, scales)
        out += [d * sc * (qs[32 * run + i] & 0x0F) - dmin * mn for i in range(32)]
        sc, mn = _q4_k_scale_min(2 * run + 1, scales)
        out += [d * sc * (qs[32 * run + i] >> 4) - dmin * mn for i in range(32)]
    return out


def q6_k(block: bytes) -> list[float]:
    ql, qh = block[0:128], block[128:192]
    sc = struct.unpack_from("<16b", block, 192)
    d = _fp16(block, 208)
    out = [0.0] * 256
    for half in range(2):
        for i in range(32):
            lo, hi, base, s = 64 * half, 32 * half, 128 * half, 8 * half
            h = qh[hi + i]
            codes = ((ql[lo + i] & 0x0F) | ((h & 3) << 4), (ql[lo + i + 32] & 0x0F) | (((h >> 2) & 3) << 4),
                     (ql[lo + i] >> 4) | (((h >> 4) & 3) << 4), (ql[lo + i + 32] >> 4) | (((h >> 6) & 3) << 4))
            for quarter, c in enumerate(codes):
                out[base + 32 * quarter + i] = d * sc[s + i // 16 + 2 * quarter] * (c - 32)
    return out


DECODERS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q6_K": q6_k}


def exact_dequantize(fmt, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """float64 [rows, cols]: the exact value of every weight."""
    blocks = np.asarray(raw, np.uint8).reshape(-1, fmt.block_bytes)
    values = [DECODERS[fmt.name](bytes(b)) for b in blocks]
    return np.array(values, np.float64).reshape(shape)
