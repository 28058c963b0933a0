"""Projections on quantized weights (gpu/quant_weights.py's QuantMatrix): what cuda/gemv_quant.cu's
kernels need from the GEMV launchers of gpu/ops/gemv.py (which launch them, QuantGemvOps' docstring
says how), prefill's dequantization, and quant_linear(), which linear() hands a QuantMatrix to.

quant_linear(): Y[m, n] (+)= X[m, k] @ W[n, k]^T with W quantized:
  * m <= GEMV_MAX_ROWS (decode): gemv() on gemv_quant_<kind>, the weight bytes read once, dequantized
    in registers (FP8: one byte a weight, its row scale on the fp32 sum; Q4_0 / Q4_1: half a byte).
  * larger m (prefill, big batches) with the matrix within the dequantization scratch: dequant_<kind>
    writes W as bf16 into the scratch, then the bf16 cuBLAS GEMM. The simplest correct path: it
    keeps the GEMM on cuBLAS's tuned tensor-core kernels at the cost of writing and reading W in
    bf16 once more per projection (docs/perf-notes.md, section 7, predicts that cost), which a
    prefill of many tokens amortises; a tile loader dequantizing in the GEMM would avoid it.
    FP8 here multiplies each code by its scale before the bf16 rounding (the GEMM takes no per-row
    scale), so its prefill weights are bf16(q * scale) where decode uses q exactly.
  * larger m on a matrix past the scratch (the LM head, which the scratch is not sized for: a
    step's LM head has one row per sequence): the GEMV over X's rows 8 at a time.
"""
from __future__ import annotations

import functools
import math

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase
from tinyvllm.gpu.quant_weights import QuantMatrix
from tinyvllm.quant.block_format import GEMV_MAX_ROWS as QGEMV_MAX_ROWS  # the twin picks its formula by it

QGEMV = kernel_constants("gemv_quant.cu")
QGEMV_WARPS_PER_SM = 32          # the doubling rule's one-wave budget, as gemv.py's
QGEMV_MIN_STEPS_PER_WARP = 1
DEQUANT_THREADS = 256
# per kind: weights a lane holds per step (its 16 bytes), the ring slot's bytes, what k must divide into
LANE_K = {"FP8": QGEMV["LANE_K_BYTE"], "Q8_0": QGEMV["LANE_K_BYTE"], "Q4_0": QGEMV["LANE_K_NIBBLE"],
          "Q4_1": QGEMV["LANE_K_NIBBLE"], "Q4_K": QGEMV["LANE_K_NIBBLE"], "Q6_K": QGEMV["LANE_K_BYTE"],
          "EXPANDED": QGEMV["LANE_K_BYTE"]}
SLOT_BYTES = {"FP8": QGEMV["SLOT_BYTES_FP8"], "Q8_0": QGEMV["SLOT_BYTES_Q8_0"], "Q4_0": QGEMV["SLOT_BYTES_Q4"],
              "Q4_1": QGEMV["SLOT_BYTES_Q4"], "Q4_K": QGEMV["SLOT_BYTES_Q4_K"], "Q6_K": QGEMV["SLOT_BYTES_Q6_K"],
              "EXPANDED": QGEMV["SLOT_BYTES_EXPANDED"]}
GEMV_ROLES = ("gemv_bf16", "gemv_residual_norm_bf16", "gemv_prenormed_rope_kv_bf16",
              "gemv_prenormed_rope_kv_bias_bf16", "gemv_prenormed_bf16", "gemv_prenormed_silu_mul_bf16",
              "gemv_prenormed_gelu_mul_bf16")   # gemv.cu's kernels a quantized kind stands in for
K_MULTIPLE = {"FP8": 16, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256, "EXPANDED": 32}


@functools.lru_cache(maxsize=None)
def max_k_warps(kind: str) -> int:
    """A CTA's most warps for this kind (gemv_quant.cu's Format::MAX_WARPS, its launch bound)."""
    return QGEMV["MAX_K_WARPS_FP8"] if kind == "FP8" else QGEMV["MAX_K_WARPS"]


def ring_bytes_per_warp(kind: str) -> int:
    """A warp's partial tile and its ring of RING_STEPS slots."""
    return QGEMV["PARTIAL_BYTES"] + QGEMV["RING_STEPS"] * SLOT_BYTES[kind]


def quant_gemv_shape(kind: str, n: int, k_warps: int) -> tuple:
    """(grid, block, shared_bytes): one CTA per 16 outputs, k_warps warps splitting K."""
    if not 1 <= k_warps <= max_k_warps(kind):
        raise ValueError(f"k_warps must be in 1..{max_k_warps(kind)} for {kind}, got {k_warps}")
    return (math.ceil(n / QGEMV["ROWS_PER_CTA"]), 1, 1), (32 * k_warps, 1, 1), k_warps * ring_bytes_per_warp(kind)


class QuantGemvOps(OpsBase):
    """The quantized kinds' side of the GEMV launchers. gpu/ops/gemv.py's launchers (gemv(),
    gemv_residual_norm(), gemv_rope_kv(), gemv_silu_mul()) take a QuantMatrix where they take a bf16
    W and launch its kind's namesake of their kernel (weight_kernel) with the two planes in W's
    place (quant_weight_args) and this kernel's launch shape (quant_launch_shape); so the fused
    decode layer runs on quantized weights as on bf16 ones."""
    # each kind's kernels (cuda/gemv_quant.cu), by the gemv.cu kernel they stand in for: the
    # namesake rule gemv_<role>_bf16 -> gemv_quant_<role>_<kind>, and dequant_<kind> for prefill
    KERNELS = {kind: {**{base: f"gemv_quant{base[len('gemv'):-len('_bf16')]}_{kind.lower()}" for base in GEMV_ROLES},
                      "dequant": f"dequant_{kind.lower()}"} for kind in SLOT_BYTES}
    dequant_scratch: int = 0          # bf16 scratch for prefill (DeviceWeights'), set by use_dequant_scratch
    dequant_scratch_elems: int = 0

    def use_dequant_scratch(self, ptr: int, elems: int) -> None:
        """Where prefill dequantizes a quantized matrix (DeviceWeights.dequant_scratch)."""
        self.dequant_scratch, self.dequant_scratch_elems = int(ptr), int(elems)

    def weight_kernel(self, kernel: str, w) -> str:
        """The kernel to launch for gemv.cu's `kernel` on weight w: itself for a bf16 pointer, its
        kind's namesake for a QuantMatrix."""
        return self.KERNELS[w.kind][kernel] if isinstance(w, QuantMatrix) else kernel

    def quant_weight_args(self, what: str, w: QuantMatrix, n: int, k: int) -> tuple[int, int]:
        """(quants plane, scales plane): a QuantMatrix's kernel arguments, checked against the [n, k]
        the launch asks for and the kind's k multiple."""
        if (n, k) != (w.rows, w.cols):
            raise ValueError(f"{what}: a {w.rows}x{w.cols} {w.kind} matrix used as {n}x{k}")
        if k % K_MULTIPLE[w.kind]:
            raise ValueError(f"{what}: a {w.kind} GEMV needs k % {K_MULTIPLE[w.kind]} == 0, got k = {k}")
        return w.data, w.scales

    def quant_launch_shape(self, w: QuantMatrix, k_warps: int | None = None, last: bool = False) -> tuple:
        """(grid, block, shared_bytes) of a quantized GEMV (prenormed kernels add the row sums)."""
        return quant_gemv_shape(w.kind, w.rows, k_warps or self.quant_k_warps(w, last))

    def quant_k_warps(self, w: QuantMatrix, last: bool = False) -> int:
        """gemv.py's doubling rule on this kernel's steps: double the k-split while the grid stays
        within one wave, every warp keeps QGEMV_MIN_STEPS_PER_WARP step, and the CTA's rings with
        a prenormed kernel's row sums (2k bytes at m = 8) fit gemv_quant.cu's MAX_SHARED_BYTES.
        last (the LM head): gemv_k_warps' rule for it, past one wave while every warp keeps a full
        ring. A quantized lane-step dequantizes 32-64 weights (gemv.cu's: 8), so a warp's steps are
        long chains of arithmetic: at small k the work is split as finely as the steps allow.
        Measured alone at SmolLM2's shapes (benchmarks/gemv_bench.py --shapes 135m --kind Q4_1 |
        Q8_0; H100, 2026-12-07, 9616334): Q4_1's choices (4, 4, 4, 8 warps for qkv, o, gate_up,
        down) are the fastest split of each, 2-32 % faster than at two steps a warp at least; Q8_0's
        8 for qkv / o / gate_up 28-35 % faster, but its down at 16 is 21 % slower than at 8 and
        its head at 2 warps 12 % slower than at 8."""
        ctas, steps = math.ceil(w.rows / QGEMV["ROWS_PER_CTA"]), math.ceil(w.cols / (4 * LANE_K[w.kind]))
        kw, most, per_warp = 1, max_k_warps(w.kind), ring_bytes_per_warp(w.kind)
        while (kw < most and steps >= kw * 2 * QGEMV_MIN_STEPS_PER_WARP
               and (ctas * kw * 2 <= self.num_sms * QGEMV_WARPS_PER_SM
                    or (last and steps >= kw * 2 * QGEMV["RING_STEPS"]))
               and kw * 2 * per_warp + 2 * w.cols <= QGEMV["MAX_SHARED_BYTES"]):
            kw *= 2
        return kw

    def quant_linear(self, y, x, w: QuantMatrix, m: int, n: int, k: int, *, accumulate: bool = False,
                     out_dtype: str = "bfloat16") -> None:
        """linear() on a QuantMatrix (module docstring for the path each m takes)."""
        if (n, k) != (w.rows, w.cols):
            raise ValueError(f"quant_linear: a {w.rows}x{w.cols} {w.kind} matrix used as {n}x{k}")
        if m <= QGEMV_MAX_ROWS:
            self.gemv(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype)
        elif n * k <= self.dequant_scratch_elems:
            self.dequantize(self.dequant_scratch, w, 0, n)
            self.blas.matmul(y, x, self.dequant_scratch, m, n, k, accumulate=accumulate, out_dtype=out_dtype)
        else:
            item = 4 if out_dtype == "float32" else 2
            for r in range(0, m, QGEMV_MAX_ROWS):
                self.gemv(int(y) + r * n * item, int(x) + r * k * 2, w, min(QGEMV_MAX_ROWS, m - r), n, k,
                          accumulate=accumulate, out_dtype=out_dtype)

    def dequantize(self, out, w: QuantMatrix, row0: int, rows: int) -> None:
        """out [rows, k] bf16 = rows row0 .. row0 + rows of W as bf16 (dequant_<kind>: the GGUF kinds
        as the GEMV's registers hold them, FP8 as bf16(code * scale)); out 16-byte aligned."""
        if row0 < 0 or rows < 1 or row0 + rows > w.rows:
            raise ValueError(f"dequantize: rows {row0}..{row0 + rows} of a {w.rows}-row matrix")
        if int(out) & 15 or w.cols % K_MULTIPLE[w.kind]:
            raise ValueError(f"dequantize: out must be 16-byte aligned and k a multiple of {K_MULTIPLE[w.kind]}")
        groups = rows * (w.cols // 8)
        blocks = min(math.ceil(groups / DEQUANT_THREADS), 32 * self.num_sms)
        self._launch(self.KERNELS[w.kind]["dequant"], blocks, DEQUANT_THREADS, int(out), w.data, w.scales, row0,
                     rows, w.cols)
