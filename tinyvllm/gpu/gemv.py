"""Small-batch bf16 GEMV for decode (cuda/gemv.cu): the M <= 8 twin of `Cublas.linear`.

`Gemv.linear(y, x, w, m, n, k)` computes Y[m, n] (+)= X[m, k] @ W[n, k]^T exactly like
`Cublas.linear` (same argument order, row-major buffers, W as HF stores it [out, in], fp32
accumulation, bf16 or fp32 Y, accumulate = beta 1), for 1 <= m <= 8 and k % 8 == 0, with x and w
16-byte aligned. It streams W once with 16-byte loads and does the math on the tensor cores; see
the kernel's header comment for the layout. No workspace, no allocation, one launch per call on
the kernel library's stream (so it can be captured in a CUDA graph).

The launch shape is one CTA per 16 output columns and `kw` warps per CTA splitting K; `kw` is
chosen per (n, k) so that the grid fills the GPU about once (see `_k_warps`). `k_warps=` overrides
it (tests and the benchmark's sweep use that).
"""
from __future__ import annotations

from tinyvllm.gpu.kernels import KernelLibrary, register

# cuda/gemv.cu: y, x, w, m, n, k, out_f32, accumulate
register({"gemv_bf16": "PPPiiiii"})

ROWS_PER_CTA = 16      # outputs n per CTA (one m16n8k16 tile of W rows)
STEP_K = 32            # k per warp step
UNROLL = 4             # steps in flight per warp
MAX_K_WARPS = 32       # warps per CTA: blockDim.x <= 1024
WARPS_PER_SM = 32      # residency at the kernel's 64 registers per thread
MAX_K = 1 << 26        # the kernel's int step arithmetic (steps * warps) stays below 2^31
OUT_DTYPES = {"bfloat16": 0, "float32": 1}


class Gemv:
    """Y[m, n] (+)= X[m, k] @ W[n, k]^T for decode batches of 1..MAX_ROWS rows."""

    MAX_ROWS = 8

    def __init__(self, kernels: KernelLibrary, num_sms: int | None = None):
        self.kernel = kernels["gemv_bf16"]
        if num_sms is None:
            import pycuda.driver as drv
            num_sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.num_sms = int(num_sms)
        self._launch: dict[tuple[int, int, int], tuple] = {}   # (n, k, kw) -> grid, block, shared

    @staticmethod
    def supports(m: int, n: int, k: int) -> bool:
        """True when linear() handles this shape (the caller falls back to cuBLAS otherwise)."""
        return 1 <= m <= Gemv.MAX_ROWS and n >= 1 and 8 <= k < MAX_K and k % 8 == 0

    def _k_warps(self, n: int, k: int) -> int:
        """Warps per CTA splitting K: double while the grid stays within one full wave
        (num_sms * 32 warps) and every warp keeps at least one full batch of UNROLL steps.
        Llama-3.2-1B on 132 SMs: qkv, o -> 16; down -> 32; gate_up -> 4; lm_head -> 1."""
        ctas, steps = -(-n // ROWS_PER_CTA), -(-k // STEP_K)
        kw = 1
        while (kw < MAX_K_WARPS and ctas * kw * 2 <= self.num_sms * WARPS_PER_SM
               and steps >= kw * 2 * UNROLL):
            kw *= 2
        return kw

    def launch_shape(self, n: int, k: int, k_warps: int | None = None) -> tuple:
        """(grid, block, shared_bytes) for an (n, k) weight; cached, so a call costs a dict lookup."""
        kw = k_warps or self._k_warps(n, k)
        key = (n, k, kw)
        shape = self._launch.get(key)
        if shape is None:
            if not 1 <= kw <= MAX_K_WARPS:
                raise ValueError(f"k_warps must be in 1..{MAX_K_WARPS}, got {kw}")
            shape = ((-(-n // ROWS_PER_CTA), 1, 1), (32 * kw, 1, 1), kw * 8 * ROWS_PER_CTA * 4)
            self._launch[key] = shape
        return shape

    def linear(self, y, x, w, m: int, n: int, k: int, *, accumulate: bool = False,
               out_dtype: str = "bfloat16", k_warps: int | None = None) -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T; same arguments and meaning as `Cublas.linear`.

        y, x, w: device pointers (ints, or objects with __int__/__index__ such as arena views);
        X [m, k] and W [n, k] bf16 row-major, Y [m, n] row-major bf16 or fp32 (`out_dtype`).
        accumulate=True adds to Y (the fused residual add of o_proj and down_proj). Y must not
        overlap X or W. Requires supports(m, n, k) and 16-byte aligned x and w."""
        if not self.supports(m, n, k):
            raise ValueError(f"Gemv.linear: unsupported shape m={m}, n={n}, k={k} (needs 1 <= m <= "
                             f"{self.MAX_ROWS}, n >= 1, k % 8 == 0, 8 <= k < {MAX_K}); use Cublas.linear")
        out = OUT_DTYPES.get(out_dtype)
        if out is None:
            raise ValueError(f"Gemv.linear: out_dtype must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
        x_ptr, w_ptr = int(x), int(w)
        if (x_ptr | w_ptr) & 15:
            raise ValueError(f"Gemv.linear: x and w must be 16-byte aligned (x={x_ptr:#x}, w={w_ptr:#x})")
        grid, block, shared = self.launch_shape(n, k, k_warps)
        self.kernel(grid, block, int(y), x_ptr, w_ptr, m, n, k, out, int(accumulate),
                    shared_bytes=shared)
