"""cuBLASLt through ctypes: the FP8 GEMM with a float32 scale per row of each operand, which runs an
FP8 projection of more than 8 rows as W8A8 (gpu/ops/quant_gemv.py; its twin quant/fp8.py's
w8a8_linear):

    Y[m, n] (+)= fl32(sum_c qx[m, c] * q[n, c]) * w_scale[n] * x_scale[m]     (e4m3 codes, bf16 Y)

Layout: the transpose trick of Cublas.matmul's docstring (gpu/cublas.py), with e4m3 operands: A =
the weight codes [n, k] (op T), B = the activation codes [m, k] (op N), D = Y [m, n] as cuBLAS's
column-major n x m (ld n). FP8 on Hopper runs only in this "TN" form (A transposed, B not), which
is the form the trick gives anyway.

Scales, outer-vector mode (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, cuBLAS 12.9+, sm_90): A's
scale is a float32 vector over op(A)'s rows (cuBLAS's M = our n: the weight's row scales), B's over
op(B)'s columns (cuBLAS's N = our m: the tokens' scales), both applied to the fp32 sum:
D_ij = alpha * sA_i * sB_j * sum_l a_il b_lj + beta * C_ij (cuBLAS documentation, "Outer Vector
Scaling for FP8 Data Types", which lists D as 16F, 16BF or 32F). accumulate: beta = 1 with C = D = Y,
the residual add fused into o_proj and down_proj as in Cublas.matmul.

CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0: Hopper's FP8 MMA keeps its accumulator in reduced precision
(fewer mantissa bits than fp32); without fast accumulation cuBLAS moves the partial sums into fp32
registers every few MMAs, so the k-sum is an fp32 sum as the twin's (fast accumulation would let
the error grow with k). Compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, as FP8 requires.

A plan (descriptor, layouts, the heuristic's algorithm) is made once per (m, n, k, accumulate) and
kept in a bounded cache; the scale pointers, which differ per matrix, are set on it at each call.
The workspace is the cuBLAS handle's own (the arena's, same stream, calls in sequence). A call
allocates no device memory and never synchronizes (making a plan is host work: descriptors and the
heuristic query), so a CUDA graph may capture it; the cache holds the decode graphs' sizes (16 above
8 at 256 sequences, 4 shapes each) with room for prefill's.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

from tinyvllm.gpu.cublas import CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, OP_N, OP_T, CublasError, load_libcublas

# cublasLtMatmulDescAttributes_t, cublasLtMatmulMatrixScale_t, cublasLtMatmulPreferenceAttributes_t
# as numbered in cublasLt.h of CUDA 13.0 (the scale modes since 12.9; nvmath-python's bindings,
# generated from the headers up to 13.1, agree)
DESC_TRANSA, DESC_TRANSB = 3, 4                      # int32 (cublasOperation_t)
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18  # const void* (device)
DESC_FAST_ACCUM = 25                                 # int8
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32        # int32 (cublasLtMatmulMatrixScale_t)
MATRIX_SCALE_OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE_BYTES = 1                         # uint64
CUDA_R_8F_E4M3 = 28                                  # cudaDataType_t (library_types.h)
MIN_VERSION = 120900                                 # cublasLtGetVersion() of cuBLAS 12.9
PLAN_CACHE_SIZE = 128
FP8_K_MULTIPLE = 16                                  # FP8 operands: 16-byte rows, 16-byte pointers


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True, eq=False)
class Plan:
    """One shape's descriptor, its three layouts (C shares D's) and the algorithm chosen for them."""
    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    d: ctypes.c_void_p
    heuristic: HeuristicResult


class CublasLt:
    """One cuBLASLt handle with the stream and workspace of the Cublas handle beside it."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int):
        self.lib = lib = load_libcublas("cublasLt")
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasLtGetVersion.restype = sz
        lib.cublasLtGetStatusString.restype, lib.cublasLtGetStatusString.argtypes = ctypes.c_char_p, [i32]
        for name, args in (("cublasLtCreate", [ctypes.POINTER(vp)]), ("cublasLtDestroy", [vp]),
                           ("cublasLtMatmulDescCreate", [ctypes.POINTER(vp), i32, i32]),
                           ("cublasLtMatmulDescSetAttribute", [vp, i32, vp, sz]),
                           ("cublasLtMatmulDescDestroy", [vp]),
                           ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(vp), i32, ctypes.c_uint64,
                                                           ctypes.c_uint64, ctypes.c_int64]),
                           ("cublasLtMatrixLayoutDestroy", [vp]),
                           ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(vp)]),
                           ("cublasLtMatmulPreferenceSetAttribute", [vp, i32, vp, sz]),
                           ("cublasLtMatmulPreferenceDestroy", [vp]),
                           ("cublasLtMatmulAlgoGetHeuristic", [vp, vp, vp, vp, vp, vp, vp, i32,
                                                               ctypes.POINTER(HeuristicResult), ctypes.POINTER(i32)]),
                           ("cublasLtMatmul", [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp])):
            getattr(lib, name).argtypes = args
        version = int(lib.cublasLtGetVersion())
        if version < MIN_VERSION:
            raise CublasError(f"cuBLASLt {version} is older than 12.9, the first with per-row FP8 scales; "
                              "the FP8 prefill GEMM needs CUDA 12.9 or later")
        self.stream, self.workspace, self.workspace_bytes = vp(stream_handle), vp(workspace_ptr), workspace_bytes
        self.handle, self.pref = vp(), vp()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, self.pref, PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(workspace_bytes))
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.cublasLtGetStatusString(status).decode()
            raise CublasError(f"{what} failed: {msg} (status {status})")

    def _set(self, setter, obj, attribute: int, value) -> None:
        self._check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)),
                    f"{setter.__name__}(attribute {attribute})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def _plan(self, m: int, n: int, k: int, accumulate: bool, x_scales: int, w_scales: int) -> Plan:
        """The cached plan of a shape, made on first use: descriptor, layouts, the heuristic's best
        algorithm; none is one error naming the shape."""
        key = (m, n, k, accumulate)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        lib, desc = self.lib, ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attribute, value in ((DESC_TRANSA, ctypes.c_int32(OP_T)), (DESC_TRANSB, ctypes.c_int32(OP_N)),
                                 (DESC_FAST_ACCUM, ctypes.c_int8(0)),
                                 (DESC_A_SCALE_MODE, ctypes.c_int32(MATRIX_SCALE_OUTER_VEC_32F)),
                                 (DESC_B_SCALE_MODE, ctypes.c_int32(MATRIX_SCALE_OUTER_VEC_32F))):
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, attribute, value)
        plan = Plan(desc, self._layout(CUDA_R_8F_E4M3, k, n, k), self._layout(CUDA_R_8F_E4M3, k, m, k),
                    self._layout(CUDA_R_16BF, n, m, n), HeuristicResult())
        self._set_scales(plan, x_scales, w_scales)
        found = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, plan.a, plan.b, plan.d, plan.d, self.pref, 1,
                                                    ctypes.byref(plan.heuristic), ctypes.byref(found))
        if status != 0 or found.value < 1:
            self._destroy(plan)
            why = f"{lib.cublasLtGetStatusString(status).decode()} (status {status})" if status else "no result"
            raise CublasError(f"cuBLASLt has no FP8 GEMM for m={m}, n={n}, k={k}, accumulate={accumulate} "
                              f"(e4m3 x e4m3 -> bf16, per-row scales, {self.workspace_bytes:,}-byte workspace): {why}")
        self._plans[key] = plan
        if len(self._plans) > PLAN_CACHE_SIZE:
            self._destroy(self._plans.popitem(last=False)[1])
        return plan

    def _set_scales(self, plan: Plan, x_scales: int, w_scales: int) -> None:
        for attribute, ptr in ((DESC_A_SCALE_POINTER, w_scales), (DESC_B_SCALE_POINTER, x_scales)):
            self._set(self.lib.cublasLtMatmulDescSetAttribute, plan.desc, attribute, ctypes.c_void_p(ptr))

    def _destroy(self, plan: Plan) -> None:
        for layout in (plan.a, plan.b, plan.d):
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(plan.desc)

    def fp8_matmul(self, y: int, x_codes: int, w_codes: int, x_scales: int, w_scales: int, m: int, n: int, k: int,
                   *, accumulate: bool = False) -> None:
        """Y[m, n] (+)= the module docstring's product: Y bf16 [m, n], X's codes uint8 [m, k] and
        scales float32 [m], W's codes uint8 [n, k] and scales float32 [n], all row-major on the
        device, pointers 16-byte aligned, k a multiple of 16."""
        if k % FP8_K_MULTIPLE or any(int(p) % 16 for p in (y, x_codes, w_codes)):
            raise ValueError(f"fp8_matmul: k must be a multiple of {FP8_K_MULTIPLE} and Y, X and W 16-byte "
                             f"aligned (m={m}, n={n}, k={k})")
        plan = self._plan(m, n, k, accumulate, int(x_scales), int(w_scales))
        self._set_scales(plan, int(x_scales), int(w_scales))
        y = ctypes.c_void_p(int(y))
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(self._one), ctypes.c_void_p(int(w_codes)), plan.a,
            ctypes.c_void_p(int(x_codes)), plan.b, ctypes.byref(self._one if accumulate else self._zero),
            y, plan.d, y, plan.d, ctypes.byref(plan.heuristic.algo), self.workspace, self.workspace_bytes,
            self.stream), f"cublasLtMatmul (FP8, m={m}, n={n}, k={k})")

    def close(self) -> None:
        while self._plans:
            self._destroy(self._plans.popitem()[1])
        if self.handle:
            self.lib.cublasLtMatmulPreferenceDestroy(self.pref)
            self.lib.cublasLtDestroy(self.handle)
            self.handle = ctypes.c_void_p()
