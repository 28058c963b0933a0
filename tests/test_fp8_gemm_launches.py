"""FP8's W8A8 path on the CUDA backend, checked on the CPU: quant_linear() on an FP8 matrix of more
than 8 rows launches cuda/fp8_quant.cu's quantize_rows_e4m3 (against its C signature, through
test_family_launches.py's checked kernel library) and hands cuBLASLt the right pointers, shapes
and scales; up to 8 rows and on the LM head it stays on the GEMV. The model's prefill on FP8
weights does so for every projection; the arena holds the activation buffers only with FP8
weights, and the upload plan reserves no dequantization scratch for them. gpu/cublaslt.py's
calls are checked against a recording stand-in of libcublasLt: the descriptor's attributes (the
header's numbers), the layouts of the transpose trick, the plan cache."""
from __future__ import annotations

import ctypes
import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from test_family_launches import _CheckedLaunches, _configs, _fake
from test_trace import _FakeArena

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.gpu.arena import ArenaDims, ArenaLayout
from tinyvllm.gpu.cublas import CublasError
from tinyvllm.gpu.cublaslt import CublasLt
from tinyvllm.gpu.device_weights import device_host_tensors, w8a8_max_k
from tinyvllm.gpu.model import LlamaModel, StepShape
from tinyvllm.gpu.ops import GEMV_MAX_ROWS, GpuOps
from tinyvllm.gpu.ops.quant_gemv import QGEMV_MAX_ROWS
from tinyvllm.gpu.quant_weights import QuantMatrix
from tinyvllm.quant import fp8

CODES, SCALES, ROWS, COLS = 0x7A0000000000, 0x7B0000000000, 64, 4096


class _RecordingLt:
    """CublasLt's fp8_matmul, recorded."""

    def __init__(self):
        self.calls = []

    def fp8_matmul(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def _ops():
    ops = GpuOps(_CheckedLaunches(), blas=None, num_sms=132)
    lt = _RecordingLt()
    ops.use_w8a8(lt, CODES, SCALES, ROWS, COLS)
    return ops, lt


def _fp8(n: int, k: int) -> QuantMatrix:
    return QuantMatrix("FP8", 0x7C0000000000, 0x7C8000000000, n, k, n * k + 4 * n)


def test_the_row_limit_is_defined_once():
    assert QGEMV_MAX_ROWS == GEMV_MAX_ROWS == fp8.WEIGHT_ONLY_MAX_ROWS == 8


@pytest.mark.parametrize("accumulate", [False, True])
def test_an_fp8_projection_of_9_rows_quantizes_x_then_calls_the_fp8_gemm(accumulate):
    ops, lt = _ops()
    w, y, x = _fp8(3072, 2048), 0x7D0000000000, 0x7E0000000000
    ops.linear(y, x, w, 9, 3072, 2048, accumulate=accumulate)
    assert ops.library.launched == ["quantize_rows_e4m3"]
    assert ops.library.calls[0][1] == (CODES, SCALES, x, 9, 2048)       # codes, scales, X, m, k
    assert lt.calls == [((y, CODES, w.data, SCALES, w.scales, 9, 3072, 2048), {"accumulate": accumulate})]


def test_up_to_8_rows_and_on_the_lm_head_fp8_stays_on_the_gemv():
    ops, lt = _ops()
    w = _fp8(576, 576)
    ops.linear(0x7D0000000000, 0x7E0000000000, w, 8, 576, 576)
    assert ops.library.launched == ["gemv_quant_fp8"]
    ops.library.launched.clear()
    ops.linear(0x7D0000000000, 0x7E0000000000, w, 37, 576, 576, out_dtype="float32", last=True)
    assert ops.library.launched == ["gemv_quant_fp8"] * 5 and not lt.calls      # 37 rows, 8 at a time


def test_w8a8_refuses_what_it_cannot_hold_in_one_error_each():
    ops, _ = _ops()
    with pytest.raises(ValueError, match="hold 64 rows of 4096"):
        ops.linear(0, 0, _fp8(128, 4096), 65, 128, 4096)
    with pytest.raises(ValueError, match="hold 64 rows of 4096"):
        ops.linear(0, 0, _fp8(128, 8192), 9, 128, 8192)
    with pytest.raises(ValueError, match="writes bf16"):
        ops.w8a8(0, 0, _fp8(128, 64), 9, 128, 64, out_dtype="float32")
    bare = GpuOps(_CheckedLaunches(), blas=None, num_sms=132)
    with pytest.raises(ValueError, match="no activation buffers"):
        bare.linear(0, 0, _fp8(128, 64), 9, 128, 64)


def test_the_prefill_of_an_fp8_model_runs_every_projection_as_w8a8():
    """The real LlamaModel.forward on FP8 layer matrices: a 13-token prefill quantizes X before each
    of the 4 projections a layer and multiplies on cuBLASLt with m = 13; the bf16 LM head stays on
    cuBLAS; a 3-sequence decode runs the fused layer's FP8 GEMVs."""
    config = _configs()["llama"]
    fake = _fake(config, fused_decode=True)
    fp8_k = max(config.hidden_size, config.intermediate_size, config.q_size)
    dims = ArenaDims.from_configs(config, _engine(), fp8_k=fp8_k)      # _fake's engine config
    arena = _FakeArena(ArenaLayout.plan(dims), 0x7F0000000000)
    layers = tuple(dataclasses.replace(lw, **{p: _fp8(*shape) for p, shape in _shapes(config).items()})
                   for lw in fake.weights.layers)
    weights = dataclasses.replace(fake.weights, layers=layers)
    lt = _RecordingLt()
    fake.ops.use_w8a8(lt, arena.view("fp8_act_codes"), arena.view("fp8_act_scales"), dims.tokens, dims.fp8_k)
    model = LlamaModel(config, weights, arena, fake.kv_cache, fake.ops)
    prompt = ForwardBatch.build([list(range(1, 12)), [3, 4]], [11, 30], [[5], [6, 7]], 16, is_prefill=True)
    fake.ops.library.launched.clear()
    model.forward(StepShape(prompt.num_tokens, prompt.num_seqs, True, 11))
    L = config.num_hidden_layers
    assert fake.ops.library.launched.count("quantize_rows_e4m3") == 4 * L
    assert [call[0][5:] for call in lt.calls] == [(13, *s) for _ in range(L) for s in _shapes(config).values()]
    assert all(call[0][1] == int(arena.view("fp8_act_codes")) for call in lt.calls)
    assert [c[1]["accumulate"] for c in lt.calls] == [False, True, False, True] * L      # o and down add
    lt.calls.clear()
    fake.ops.library.launched.clear()
    model.forward(StepShape(3, 3, False))
    assert not lt.calls and "quantize_rows_e4m3" not in fake.ops.library.launched
    assert "gemv_quant_residual_norm_fp8" in fake.ops.library.launched


def _engine():
    from tinyvllm.config import EngineConfig
    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


def _shapes(config) -> dict:
    H, I = config.hidden_size, config.intermediate_size
    return {"qkv": (config.q_size + 2 * config.kv_size, H), "o": (H, config.q_size), "gate_up": (2 * I, H),
            "down": (H, I)}


def test_the_arena_holds_the_activation_codes_only_with_fp8_weights():
    config, engine = _configs()["llama"], _engine()
    plain = ArenaLayout.plan(ArenaDims.from_configs(config, engine))
    assert "fp8_act_codes" not in plain.activations
    layout = ArenaLayout.plan(ArenaDims.from_configs(config, engine, fp8_k=config.intermediate_size))
    codes, scales = layout.activations["fp8_act_codes"], layout.activations["fp8_act_scales"]
    assert codes.nbytes == 64 * config.intermediate_size and scales.nbytes == 64 * 4
    for other in layout.activations.values():      # own storage: beside X and Y of every projection
        if other.name not in ("fp8_act_codes", "fp8_act_scales"):
            for mine in (codes, scales):
                assert mine.offset + mine.nbytes <= other.offset or other.offset + other.nbytes <= mine.offset
    assert layout.activation_bytes >= plain.activation_bytes + codes.nbytes + scales.nbytes


def test_an_fp8_upload_plan_reserves_no_dequantization_scratch(tiny_model_dir):
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config, "fp8")
    plan = device_host_tensors(config, weights)
    assert plan["0.down"].kind == "FP8" and "dequant_scratch" not in plan
    assert w8a8_max_k(weights) == max(config.hidden_size, config.intermediate_size, config.q_size)
    assert w8a8_max_k({"x": np.zeros((2, 2), np.float32)}) == 0


class _FakeLtLib:
    """libcublasLt's entry points, recorded: handles are counters, the heuristic finds one algorithm
    (none with found = 0)."""

    def __init__(self, found: int = 1):
        self.calls, self.next, self.found = [], 100, found

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name.endswith("Create"):
                self.next += 1
                args[0]._obj.value = self.next
            if name == "cublasLtMatmulAlgoGetHeuristic":
                args[8]._obj.algo[0] = 77
                args[9]._obj.value = self.found
            return 0
        call.__name__ = name
        return call

    def cublasLtGetStatusString(self, status):
        return b"CUBLAS_STATUS_NOT_SUPPORTED"


def _lt(found: int = 1) -> CublasLt:
    lt = object.__new__(CublasLt)            # the real methods over the recording library
    lt.lib, lt.handle, lt.pref = _FakeLtLib(found), ctypes.c_void_p(1), ctypes.c_void_p(2)
    lt.stream, lt.workspace, lt.workspace_bytes = ctypes.c_void_p(3), ctypes.c_void_p(4), 1 << 22
    lt._one, lt._zero, lt._plans = ctypes.c_float(1.0), ctypes.c_float(0.0), OrderedDict()
    return lt


def _value(arg):
    obj = arg._obj if hasattr(arg, "_obj") else arg
    return obj.value if hasattr(obj, "value") else obj


def test_cublaslt_describes_the_tn_fp8_gemm_with_outer_vector_scales():
    lt = _lt()
    lt.fp8_matmul(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 9, 3072, 2048, accumulate=True)
    calls = lt.lib.calls
    desc = [args for name, args in calls if name == "cublasLtMatmulDescCreate"]
    assert [(a[1], a[2]) for a in desc] == [(68, 0)]                  # CUBLAS_COMPUTE_32F, CUDA_R_32F
    attrs = [(a[1], _value(a[2])) for name, a in calls if name == "cublasLtMatmulDescSetAttribute"]
    assert attrs[:5] == [(3, 1), (4, 0), (25, 0), (31, 3), (32, 3)]   # T, N, no fast accumulation, OUTER_VEC_32F
    assert attrs[5:] == [(17, 0x5000), (18, 0x4000)] * 2               # A: W's row scales, B: X's
    layouts = [a[1:] for name, a in calls if name == "cublasLtMatrixLayoutCreate"]
    assert layouts == [(28, 2048, 3072, 2048), (28, 2048, 9, 2048), (14, 3072, 9, 3072)]   # W^T, X^T, Y^T
    (matmul,) = [a for name, a in calls if name == "cublasLtMatmul"]
    assert [_value(matmul[i]) for i in (3, 5, 8, 10)] == [0x3000, 0x2000, 0x1000, 0x1000]   # A=W, B=X, C=D=Y
    assert _value(matmul[2]) == 1.0 and _value(matmul[7]) == 1.0 and matmul[9] is matmul[11]   # beta = 1
    assert matmul[14] == 1 << 22 and _value(matmul[15]) == 3
    lt.fp8_matmul(0x1000, 0x2000, 0x3000, 0x4000, 0x6000, 9, 3072, 2048, accumulate=True)
    assert sum(name == "cublasLtMatmulAlgoGetHeuristic" for name, _ in lt.lib.calls) == 1, "the plan is cached"
    assert [(a[1], _value(a[2])) for n, a in lt.lib.calls[-3:-1]] == [(17, 0x6000), (18, 0x4000)]


def test_cublaslt_without_an_algorithm_is_one_error_naming_the_shape():
    lt = _lt(found=0)
    with pytest.raises(CublasError, match="no FP8 GEMM for m=9, n=3072, k=2048"):
        lt.fp8_matmul(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 9, 3072, 2048)
    assert not lt._plans and sum(name.endswith("Destroy") for name, _ in lt.lib.calls) == 4
    with pytest.raises(ValueError, match="multiple of 16"):
        lt.fp8_matmul(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 9, 3072, 2040)
