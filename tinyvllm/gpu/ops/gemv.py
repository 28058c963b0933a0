"""The projections: `linear()`, THE projection of the model, and the launchers of our GEMV
kernels (gemv.cu).

linear(): Y[m, n] (+)= X[m, k] @ W[n, k]^T, on our GEMV for decode batches of at most
GEMV_MAX_ROWS rows (cuBLAS reads small matrices at 1.7-2.5 TB/s at M <= 8; the GEMV streams
them at 3.5+), else on cuBLAS (gpu/cublas.py has the row-major/column-major derivation). A
quantized W (gpu/quant_weights.py's QuantMatrix) goes to quant_linear() (gpu/ops/quant_gemv.py).

The fused decode layer's GEMVs (gpu/model.py) are launches of their own kernels:
gemv_residual_norm() (o and down, adding into the residual stream and handing the next RMSNorm
over), gemv_rope_kv() (qkv with RoPE and the KV-cache write in its epilogue), gemv_silu_mul()
(gate_up with silu_mul in its epilogue) and gemv(prenormed=...) (the LM head after the final
norm). gemv.cu's header has the kernel's layout and the handed-over norm's formula.
"""
from __future__ import annotations

import functools
import math

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase
from tinyvllm.gpu.quant_weights import QuantMatrix

GEMV = kernel_constants("gemv.cu")
GEMV_MAX_ROWS = 8            # the GEMV's m limit (x rows held in one m16n8k16 tile's n = 8)
GEMV_MAX_K = 1 << 26         # its int step arithmetic (steps * warps) stays below 2^31
GEMV_WARPS_PER_SM = 32       # residency at its 64 registers per thread: one wave's warps per SM
GEMV_MIN_STEPS_PER_WARP = 2  # gemv_k_warps(): the fewest 32-wide k steps a warp is left with
# The o GEMV's most k-split warps (gemv_k_warps' beside_attention): at 32 warps a CTA takes an
# SM's whole register file, so under PDL none can be resident on an SM that holds one of the
# decode attention's blocks, and those CTAs start (and stream their W) only after it ends. At 16
# all of Llama-1B's 128 o CTAs sit beside the attention with their W already in their rings:
# 1,004 -> 1,014 decode tok/s (H100, 2026-12-05, 316b548). Smaller o GEMVs (SmolLM2: 8 warps)
# are unchanged.
GEMV_BESIDE_ATTENTION_WARPS = GEMV_WARPS_PER_SM // 2
# The LM head runs on the GEMV too (gemv_k_warps' `last` rule): alone 121 us against cuBLAS's
# 127 on Llama-1B's 525 MB head (a tie inside its decode graph), and SmolLM2's decode graph
# 15-20 us shorter, where the cuBLAS kernel broke the PDL chain (H200, 2026-12-04, 8470bd1);
# the bound is the kernel's int arithmetic (n * k elements indexed as size_t, n itself an int).
GEMV_MAX_N = 1 << 30
OUT_DTYPES = {"bfloat16": 0, "float32": 1}


@functools.lru_cache(maxsize=None)
def gemv_shape(n: int, k: int, k_warps: int) -> tuple:
    """(grid, block, shared_bytes) of a GEMV launch for an [n, k] weight: one CTA per
    ROWS_PER_CTA outputs, k_warps warps splitting K, each with its partial tile and its ring."""
    if not 1 <= k_warps <= GEMV["MAX_K_WARPS"]:
        raise ValueError(f"k_warps must be in 1..{GEMV['MAX_K_WARPS']}, got {k_warps}")
    rows = GEMV["ROWS_PER_CTA"]
    per_warp = 8 * rows * 4 + GEMV["RING_BYTES_PER_WARP"]
    return (math.ceil(n / rows), 1, 1), (32 * k_warps, 1, 1), k_warps * per_warp


class GemvOps(OpsBase):
    def on_gemv(self, m: int, n: int, k: int) -> bool:
        """Whether linear() runs this shape on our GEMV (else cuBLAS)."""
        return n <= GEMV_MAX_N and self.gemv_supports(m, n, k)

    def linear(self, y, x, w, m: int, n: int, k: int, *, accumulate: bool = False,
               out_dtype: str = "bfloat16", last: bool = False, k_warps: int | None = None) -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T, row-major, W as HF stores it [out, in]; accumulate
        adds to Y (beta = 1: the fused residual add). The GEMV for small decode batches, else cuBLAS.
        last: the step's last projection (the LM head), launched by gemv_k_warps' rule for it;
        k_warps: the GEMV's k-split (None: that rule). A quantized W (a QuantMatrix) goes to
        quant_linear() (gpu/ops/quant_gemv.py), whose GEMV picks its own k-split."""
        on_gemv = self.on_gemv(m, n, k)
        if isinstance(w, QuantMatrix):
            run = lambda: self.quant_linear(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype)  # noqa: E731
            name = f"{'gemv' if m <= GEMV_MAX_ROWS else 'dequant+cublas'} {w.kind} {n}x{k}"
        elif on_gemv:
            run = lambda: self.gemv(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype, last=last,  # noqa: E731
                                    k_warps=k_warps)
            name = f"gemv {n}x{k}"
        else:
            run = lambda: self.blas.matmul(y, x, w, m, n, k, accumulate=accumulate, out_dtype=out_dtype)  # noqa: E731
            name = f"cublas {n}x{k}"
        if self.skip_ops and name in self.skip_ops:
            return
        if self.observer is not None:
            self.observer(name, self._quietly(run),
                          {"m": m, "n": n, "k": k, "accumulate": accumulate, "out_dtype": out_dtype,
                           "last": last, "y": y, "x": x, "w": w})
        self._quietly(run)()

    def fuses_decode(self, m: int, shapes: dict[str, tuple[int, int]], head_dim: int) -> bool:
        """Whether a step of m tokens runs the fused decode layer (gpu/model.py): fused_decode is
        on and its kernels can run every projection — shapes, the [n, k] weights of qkv, o,
        gate_up, down and lm_head, all on the GEMV; head_dim a multiple of 16 (RoPE's pairs in
        one CTA); gate_up's n a multiple of 16 (gate and up rows in one CTA); the hidden size a
        multiple of 64 (the prenormed GEMVs copy the row sums in whole 16-byte chunks)."""
        hidden = shapes["qkv"][1]
        return (self.fused_decode and head_dim % GEMV["ROWS_PER_CTA"] == 0 and shapes["gate_up"][0] % 16 == 0
                and hidden % 64 == 0 and all(self.on_gemv(m, n, k) for n, k in shapes.values()))

    @staticmethod
    def gemv_supports(m: int, n: int, k: int) -> bool:
        return 1 <= m <= GEMV_MAX_ROWS and n >= 1 and 8 <= k < GEMV_MAX_K and k % 8 == 0

    def gemv_k_warps(self, n: int, k: int, last: bool = False, beside_attention: bool = False) -> int:
        """Warps per CTA splitting K: double while the grid stays within one full wave
        (num_sms * GEMV_WARPS_PER_SM warps) and every warp keeps at least GEMV_MIN_STEPS_PER_WARP
        steps; beside_attention (the o GEMV, which follows the decode attention): at most
        GEMV_BESIDE_ATTENTION_WARPS.
        Llama-3.2-1B on 132 SMs: qkv -> 16, o -> 16 (32 without the cap), down -> 32, gate_up -> 4;
        SmolLM2-135M: qkv, o, gate_up -> 8, down -> 16. More warps put more of a small matrix in
        flight at once: at SmolLM2's shapes 8-16 warps of ~2 steps beat 4 of ~4 by 0.6-1.0 us per
        call (benchmarks/gemv_bench.py --shapes 135m; H200, 2026-12-03, 5ccae98).
        last: the step's last projection (the LM head), whose tail nothing can overlap (the
        sampler needs every logit). Its grid may go past one wave while every warp keeps a full
        ring of RING_STEPS steps: Llama-1B's head -> 16 warps, SmolLM2's -> 4. Alone, gemv_bench
        measures more warps faster for every big matrix (1B gate_up 17.5 us at 16 warps against
        19.1 at 4), but inside the decode graph a per-layer GEMV past one wave made the step slower
        (1B +35 us with gate_up at 16): CTAs that start in later waves hold back the next kernel's
        launch under PDL (H200, 2026-12-04, 8470bd1)."""
        ctas, steps = math.ceil(n / GEMV["ROWS_PER_CTA"]), math.ceil(k / GEMV["STEP_K"])
        kw, most = 1, GEMV_BESIDE_ATTENTION_WARPS if beside_attention else GEMV["MAX_K_WARPS"]
        while kw < most and steps >= kw * 2 * GEMV_MIN_STEPS_PER_WARP:
            one_wave = ctas * kw * 2 <= self.num_sms * GEMV_WARPS_PER_SM
            if not (one_wave or (last and steps >= kw * 2 * GEMV["RING_STEPS"])):
                break
            kw *= 2
        return kw

    def decode_k_warps(self, projection: str, n: int, k: int) -> int:
        """The k-split of a layer's projection ("qkv", "o", "gate_up" or "down") with an [n, k]
        weight: gemv_k_warps' rule, the o GEMV's beside the decode attention it follows."""
        return self.gemv_k_warps(n, k, beside_attention=projection == "o")

    def gemv_launch_shape(self, n: int, k: int, k_warps: int | None = None, last: bool = False) -> tuple:
        """(grid, block, shared_bytes) for an [n, k] weight at k_warps (None: gemv_k_warps' rule)."""
        return gemv_shape(n, k, k_warps or self.gemv_k_warps(n, k, last))

    def _gemv_args(self, what: str, x, w, m: int, n: int, k: int, out_dtype: str, k_warps, *more,
                   last: bool = False):
        """Checks shared by the GEMV launchers -> (grid, block, shared bytes, x, the weight's kernel
        arguments: w, or a QuantMatrix's two planes for the quantized kernel, gpu/ops/quant_gemv.py)."""
        if not self.gemv_supports(m, n, k):
            raise ValueError(f"{what}: unsupported shape m={m}, n={n}, k={k} (needs 1 <= m <= {GEMV_MAX_ROWS}, "
                             f"n >= 1, k % 8 == 0, 8 <= k < {GEMV_MAX_K}); use cuBLAS")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"{what}: out_dtype must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
        quantized = isinstance(w, QuantMatrix)
        x_ptr, w_args = int(x), self.quant_weight_args(what, w, n, k) if quantized else (int(w),)
        if (x_ptr | w_args[0]) & 15 or any(int(p) & 15 for p in (*w_args[1:], *more)):
            names = ", ".join(f"{p:#x}" for p in (x_ptr, *w_args, *map(int, more)))
            raise ValueError(f"{what}: x, w (and the norm weight or its row sums) must be 16-byte aligned ({names})")
        grid, block, shared = (self.quant_launch_shape(w, k_warps, last) if quantized else
                               self.gemv_launch_shape(n, k, k_warps, last))
        return grid, block, shared, x_ptr, w_args

    def gemv(self, y, x, w, m: int, n: int, k: int, *, accumulate: bool = False,
             out_dtype: str = "bfloat16", k_warps: int | None = None, last: bool = False,
             prenormed=None, head_argmax=0) -> None:
        """linear()'s small-batch path: the same arguments and meaning as Cublas.matmul, for
        1 <= m <= 8 and k % 8 == 0 with x and w 16-byte aligned. Streams W once through each
        warp's cp.async ring, maths on the tensor cores (gemv.cu's header has the layout). last:
        gemv_k_warps'. prenormed = (row_ss, eps): Y = inv_rms * (X @ W^T) with X and row_ss
        handed over by gemv_residual_norm() (gemv_prenormed_bf16: the decode LM head after the
        final norm; no accumulate, k % 64 == 0). head_argmax (uint64 [m], zeroed before:
        embedding()'s, 0: none), prenormed with fp32 Y only: each row's greedy argmax key
        (common.cuh), for sample()."""
        if head_argmax and (prenormed is None or out_dtype != "float32"):
            raise ValueError("gemv: head_argmax is kept by the prenormed GEMV with fp32 output (the decode LM head)")
        if prenormed is None:
            grid, block, shared, x_ptr, w_args = self._gemv_args("gemv", x, w, m, n, k, out_dtype, k_warps, last=last)
            self._launch(self.weight_kernel("gemv_bf16", w), grid, block, int(y), x_ptr, *w_args, m, n, k,
                         OUT_DTYPES[out_dtype], int(accumulate), shared_bytes=shared)
            return
        if accumulate:
            raise ValueError("gemv: a prenormed GEMV stores its product; accumulate is not built")
        row_ss, eps = prenormed
        grid, block, shared, x_ptr, w_args = self._gemv_args("gemv_prenormed_bf16", x, w, m, n, k, out_dtype,
                                                            k_warps, row_ss, last=last)
        shared += self._producer_ss_bytes("gemv_prenormed_bf16", m, k)
        self._launch(self.weight_kernel("gemv_prenormed_bf16", w), grid, block, int(y), x_ptr, int(row_ss), *w_args,
                     m, n, k, float(eps), OUT_DTYPES[out_dtype], head_argmax, shared_bytes=shared)

    @staticmethod
    def _producer_ss_bytes(kernel: str, m: int, k: int) -> int:
        """The shared memory a prenormed GEMV adds: the producer's m x k / 16 row sums, copied in
        whole 16-byte chunks (so k % 64 == 0)."""
        if k % 64:
            raise ValueError(f"{kernel}: needs k % 64 == 0 (whole 16-byte chunks of row sums), got k = {k}")
        return m * (k // GEMV["ROWS_PER_CTA"]) * 4

    def gemv_residual_norm(self, y, x, w, m: int, n: int, k: int, norm_weight, normed, row_ss, *,
                           k_warps: int | None = None) -> None:
        """The handed-over norm's producer (gemv.cu's header): y += X @ W^T as gemv() with
        accumulate (the o or down projection adding into the residual stream y [m, n]), and for
        the RMSNorm after it normed [m, n] = bf16(y * norm_weight) and row_ss (fp32 [m,
        ceil(n / 16)]) = each CTA's sum of its 16 new y values' squares per row: what
        gemv_rope_kv / gemv_silu_mul take as prenormed=(row_ss, eps)."""
        grid, block, shared, x_ptr, w_args = self._gemv_args("gemv_residual_norm", x, w, m, n, k, "bfloat16",
                                                            k_warps, norm_weight, normed)
        self._launch(self.weight_kernel("gemv_residual_norm_bf16", w), grid, block, int(y), x_ptr, *w_args, m, n, k,
                     int(norm_weight), int(normed), int(row_ss), shared_bytes=shared)

    def gemv_rope_kv(self, qkv, x, w, m: int, n: int, k: int, k_cache, v_cache, positions, slot_mapping,
                     inv_freq, *, num_q_heads: int, num_kv_heads: int, head_dim: int, prenormed,
                     k_warps: int | None = None, bias=0) -> None:
        """The decode qkv projection with rope_write_kv inside, on the handed-over norm: x is
        gemv_residual_norm()'s (or embedding()'s) normed output and prenormed = (row_ss, eps) its
        sums of squares; qkv = inv_rms * (x @ W^T) (reference/kernels.py: rms_norm_linear), then
        RoPE on q (in place) and k, and k, v into the paged cache at slot_mapping, as
        rope_write_kv() does (k % 64 == 0). bias (Qwen2, 0: none): the q/k/v biases [n], added
        as rope_write_kv(bias=) adds them (gemv_prenormed_rope_kv_bias_bf16)."""
        if n != (num_q_heads + 2 * num_kv_heads) * head_dim or head_dim % GEMV["ROWS_PER_CTA"]:
            raise ValueError(f"gemv_rope_kv: n = {n} must be (q heads + 2 kv heads) * head_dim with "
                             f"head_dim % {GEMV['ROWS_PER_CTA']} == 0 (heads {num_q_heads}/{num_kv_heads}, "
                             f"head_dim {head_dim})")
        kernel = "gemv_prenormed_rope_kv_bias_bf16" if bias else "gemv_prenormed_rope_kv_bf16"
        row_ss, eps = prenormed
        grid, block, shared, x_ptr, w_args = self._gemv_args(kernel, x, w, m, n, k, "bfloat16", k_warps, row_ss)
        self._launch(self.weight_kernel(kernel, w), grid, block, int(qkv), x_ptr, int(row_ss), *w_args, m, n, k,
                     float(eps), k_cache, v_cache, positions, slot_mapping, inv_freq, num_q_heads, num_kv_heads, head_dim,
                     *((bias,) if bias else ()), shared_bytes=shared + self._producer_ss_bytes(kernel, m, k))

    def gemv_silu_mul(self, act, x, w, m: int, n: int, k: int, *, prenormed, k_warps: int | None = None,
                      gelu_tanh: bool = False) -> None:
        """The decode gate_up projection with silu_mul inside, on the handed-over norm (x and
        prenormed as gemv_rope_kv()): act [m, n/2] = silu(gate) * up of inv_rms * (x @ W^T),
        W = gate_up [n, k] (gate rows first). gelu_tanh: Gemma 3's GeGLU instead, gelu_tanh(gate)
        * up (gemv_prenormed_gelu_mul_bf16: gelu_tanh_mul inside)."""
        if n % 16:
            raise ValueError(f"gemv_silu_mul: n = 2 * intermediate = {n} must be a multiple of 16")
        kernel = "gemv_prenormed_gelu_mul_bf16" if gelu_tanh else "gemv_prenormed_silu_mul_bf16"
        row_ss, eps = prenormed
        grid, block, shared, x_ptr, w_args = self._gemv_args(kernel, x, w, m, n, k, "bfloat16", k_warps, row_ss)
        self._launch(self.weight_kernel(kernel, w), grid, block, int(act), x_ptr, int(row_ss), *w_args, m, n, k,
                     float(eps), shared_bytes=shared + self._producer_ss_bytes(kernel, m, k))
