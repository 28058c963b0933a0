"""cuBLAS through ctypes: a handle bound to our stream, and the row-major `matmul()` that
gpu/ops/gemv.py's `linear()` calls for every projection the GEMV does not take.

Only what the engine needs is bound: create/destroy, set stream, set workspace, GemmEx, and the
status-string lookup so failures carry cuBLAS's own message.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
from pathlib import Path

from tinyvllm.errors import GPUUnavailableError
from tinyvllm.gpu.driver import load_enqueue_library

# cublasOperation_t, cudaDataType_t, cublasComputeType_t, cublasGemmAlgo_t (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
DTYPE_CODES = {"bfloat16": CUDA_R_16BF, "float32": CUDA_R_32F}
# cublasGemmEx's parameters after the handle, in its order (cublas_api.h); alpha/beta as floats
GEMM_EX_PARAMS = ("transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "B", "Btype", "ldb",
                  "beta", "C", "Ctype", "ldc", "computeType", "algo")


class CublasError(RuntimeError):
    pass


def _candidate_paths() -> list[str]:
    names = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "lib64")
    dirs += [Path("/usr/local/cuda/lib64")]
    # pip's nvidia-cublas wheels: site-packages/nvidia/<pkg>/lib
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        dirs += [Path(p) for p in glob.glob(os.path.join(sp, "nvidia", "*", "lib"))]
    paths = [str(d / n) for d in dirs for n in names if (d / n).exists()]
    found = ctypes.util.find_library("cublas")  # ldconfig
    return paths + ([found] if found else []) + names


def load_libcublas() -> ctypes.PyDLL:
    """libcublas, its calls keeping the GIL (driver.load_enqueue_library says why)."""
    errors = []
    for path in _candidate_paths():
        try:
            return load_enqueue_library(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise GPUUnavailableError("libcublas not found (looked in $CUDA_HOME/lib64, /usr/local/cuda/lib64, "
                              "the nvidia pip wheels and ldconfig); install the CUDA toolkit or set CUDA_HOME")


class Cublas:
    """One cuBLAS handle, bound to one stream with a fixed workspace (so graph capture is legal)."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int):
        self.lib = lib = load_libcublas()
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        lib.cublasGetStatusString.restype = ctypes.c_char_p
        lib.cublasGetStatusString.argtypes = [i32]
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32,
                                     vp, vp, i32, i32, i32, i32]
        self.handle = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetStream_v2(self.handle, vp(stream_handle)), "cublasSetStream")
        self._check(lib.cublasSetWorkspace_v2(self.handle, vp(workspace_ptr), workspace_bytes),
                    "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # observer(arguments): told the exact GemmEx arguments of each call (tinyvllm/trace.py),
        # a dict keyed by GEMM_EX_PARAMS; None (the default) costs one attribute test per call
        self.observer = None

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.cublasGetStatusString(status).decode()
            raise CublasError(f"{what} failed: {msg} (status {status})")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()

    def matmul(self, y: int, x: int, w: int, m: int, n: int, k: int, *, accumulate: bool = False,
               out_dtype: str = "bfloat16") -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T with row-major buffers: the transpose trick.

        Our buffers are row-major; cuBLAS is column-major. A row-major matrix A[r, c] occupies
        exactly the bytes of the column-major matrix A^T[c, r] (leading dimension c). So:

          * X[m, k] row-major  is, to cuBLAS, X^T: k x m column-major, ld = k
          * W[n, k] row-major  (HF's [out_features, in_features]) is W^T: k x n, ld = k
          * Y[m, n] row-major  is Y^T: n x m column-major, ld = n

        We want Y = X W^T, i.e. Y^T = W X^T. In cuBLAS's column-major terms that is
        C(n x m) = op(A) op(B) with A = the k x n buffer of W transposed (OP_T -> n x k) and
        B = the k x m buffer of X untransposed (OP_N): so GemmEx(OP_T, OP_N, n, m, k, W, k, X, k,
        Y, n). No data moves; only the roles of the pointers and the shapes swap.

        accumulate=True sets beta = 1: Y += X W^T, which fuses the residual add into o_proj and
        down_proj. X and W are bf16; Y is bf16 or fp32 (the LM head writes fp32 logits); the
        accumulation is fp32 (CUBLAS_COMPUTE_32F).
        """
        args = (OP_T, OP_N, n, m, k, 1.0, int(w), CUDA_R_16BF, k, int(x), CUDA_R_16BF, k,
                1.0 if accumulate else 0.0, int(y), DTYPE_CODES[out_dtype], n,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if self.observer is not None:
            self.observer(dict(zip(GEMM_EX_PARAMS, args)))
        ta, tb, m_, n_, k_, _, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc, compute, algo = args
        self._check(self.lib.cublasGemmEx(
            self.handle, ta, tb, m_, n_, k_, ctypes.byref(self._one),
            ctypes.c_void_p(a), a_type, lda, ctypes.c_void_p(b), b_type, ldb,
            ctypes.byref(self._one if beta else self._zero),
            ctypes.c_void_p(c), c_type, ldc, compute, algo), "cublasGemmEx")
