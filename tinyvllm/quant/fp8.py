"""FP8 (e4m3) weights: one byte per weight plus float32 scales, per output channel or per tensor.

The code: float8_e4m3fn (ml_dtypes), 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
infinities, one NaN pattern per sign (0x7F / 0xFF). Finite values: normals 2^-6 .. 448 with
spacing 2^(e-3), subnormals k * 2^-9 (k = 1..7). A weight matrix W [rows, cols] (Hugging Face
order: rows are output features) is stored as codes q [rows, cols] (one byte each, row-major) and
`scale`: float32 [rows] (per channel) or a float32 scalar (per tensor); W ~ q * scale.

Quantizing a bf16 matrix (quantize_per_channel, the scheme of compressed-tensors' FP8_DYNAMIC:
static per-channel weight scales; the activations stay bf16 here):
    amax[r]  = max_c |W[r, c]|                            (exact, in float32)
    scale[r] = fl32(amax[r] / 448)                         (448: e4m3's largest finite value)
    q[r, c]  = e4m3_rne(clip(fl32(W[r, c] / scale[r]), -448, 448))
e4m3_rne is ml_dtypes' float32 -> float8_e4m3fn conversion, round to nearest, ties to even. The
clip catches the quotient of the row's largest weight, which may exceed 448 by float32 rounding
of the scale. A row of zeros gets scale 1 (all codes 0, dequantizing to exact zeros, no division
by zero); a non-finite weight is a ModelLoadError naming the tensor.

Error of one weight (derived: 3 mantissa bits give a relative half-ulp of 2^-4 in the normal
range, an absolute half-spacing of 2^-10 in the subnormal one, each scaled back by scale[r]; the
two float32 roundings add 2^-24 relative each):
    |q * scale - W| <= (2^-4 + 2^-23) * |W| + 2^-10 * scale[r]

The FP8 GEMV (linear): e4m3 -> bf16 is exact (3 mantissa bits fit bf16's 7, exponents 2^-9 ..
2^8 fit its range), so the kernel converts each byte to bf16 in registers with no rounding, the
bf16 tensor-core MMA accumulates bf16(x) * q in float32 (each product exact), and the scale
multiplies the float32 accumulator once per output after the dot product:
    Y[m, n] = fl32( sum_c bf16(X[m, c]) * q[n, c] ) * scale[n]
This is cheaper than scaling every weight (one multiply per output instead of one per weight) and
exact where scaling first is not: bf16(q * scale) would round every weight to 8 bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tinyvllm.errors import ModelLoadError

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, eq=False)         # arrays: compared by identity
class Fp8Weight:
    """codes: float8_e4m3fn [rows, cols]; scale: float32 [rows] (per channel) or float32 0-d
    (per tensor). W ~ codes * scale, row r scaled by scale[r]."""
    codes: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        if self.codes.dtype != E4M3 or self.codes.ndim != 2:
            raise ValueError(f"FP8 codes must be a 2-D float8_e4m3fn array, got {self.codes.dtype}{self.codes.shape}")
        if self.scale.dtype != np.float32 or self.scale.shape not in ((), (self.codes.shape[0],)):
            raise ValueError(f"FP8 scale must be float32 of shape () or ({self.codes.shape[0]},), "
                             f"got {self.scale.dtype}{self.scale.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def per_channel(self) -> bool:
        return self.scale.ndim == 1

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def row_scales(self) -> np.ndarray:
        """float32 [rows]: the per-tensor scale repeated, or the per-channel scales."""
        return np.broadcast_to(self.scale, (self.codes.shape[0],))

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: fl32(q * scale), one rounding per weight."""
        return self.codes.astype(np.float32) * self.row_scales()[:, None]


def quantize_per_channel(w: np.ndarray, name: str = "weight") -> Fp8Weight:
    """A bf16 (or fp16/fp32) matrix -> FP8 codes with one float32 scale per row (module docstring)."""
    w32 = np.asarray(w).astype(np.float32)
    if w32.ndim != 2:
        raise ModelLoadError(f"tensor {name!r}: FP8 quantization takes a matrix, got shape {w32.shape}")
    if not np.isfinite(w32).all():
        raise ModelLoadError(f"tensor {name!r} holds a non-finite value; it cannot be quantized to FP8")
    amax = np.abs(w32).max(axis=1) if w32.shape[1] else np.zeros(w32.shape[0], np.float32)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    quotient = np.clip(w32 / scale[:, None], -E4M3_MAX, E4M3_MAX)
    return Fp8Weight(quotient.astype(E4M3), scale)


def dequantize_per_tensor(codes: np.ndarray, scale: float | np.ndarray) -> np.ndarray:
    """float32 [rows, cols] = fl32(q * scale) for one float32 scale of the whole tensor."""
    return Fp8Weight(np.asarray(codes), np.asarray(scale, np.float32).reshape(())).dequantize()


def dequantize_per_channel(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] = fl32(q[r, c] * scale[r]); scale [rows] or [rows, 1]."""
    codes = np.asarray(codes)
    return Fp8Weight(codes, np.asarray(scale, np.float32).reshape(codes.shape[0])).dequantize()


def linear(x: np.ndarray, weight: Fp8Weight) -> np.ndarray:
    """Y[m, n] = fl32(bf16(X)[m, :] . q[n, :]) * scale[n] in float32: the twin of the FP8 GEMV
    (module docstring). X is rounded to bf16, q widened exactly, the dot product summed in
    float32, the scale applied to the sum."""
    x32 = np.asarray(x, np.float32).astype(BF16).astype(np.float32)
    return (x32 @ weight.codes.astype(np.float32).T) * weight.row_scales()[None, :]
