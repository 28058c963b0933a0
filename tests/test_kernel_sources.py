"""The kernel facts Python reads from the .cu sources (gpu/kernels.py), checked without a GPU:
every kernel's signature parses, the launch constants the launchers use exist, and every kernel
in cuda/ has a launcher in gpu/ops/."""
from __future__ import annotations

import inspect
import re

import pytest

from tinyvllm.gpu import ops
from tinyvllm.gpu.kernels import CUDA_DIR, kernel_constants, kernel_parameters, kernel_signatures, matches


def test_signatures_match_the_c_parameter_lists():
    assert kernel_signatures("rmsnorm.cu") == {"rms_norm": "PPPPiif", "rms_norm_offset": "PPPPiiff",
                                               "rms_norm_residual_add": "PPPiiffPPP"}
    assert kernel_signatures("embedding.cu") == {"embedding_gather": "PPPPPiiiPPPP",   # + the handed-over norm, head keys
                                                 "embedding_gather_scaled": "PPPPPiiiPPPPff"}
    assert kernel_signatures("activation.cu") == {"silu_mul": "PPii", "gelu_tanh_mul": "PPii"}
    assert kernel_signatures("sampling.cu") == {"sample_tokens": "PiPPPPPPPPPPP",   # comments inside the list
                                                "apply_logit_edits": "PiPi", "step_logprobs": "PiPPiPPPP"}
    assert kernel_signatures("gemv.cu") == {"gemv_bf16": "PPPiiiii",
                                            "gemv_residual_norm_bf16": "PPPiiiPPP",     # the handed-over norm
                                            "gemv_prenormed_rope_kv_bf16": "PPPPiiifPPPPPiii",
                                            "gemv_prenormed_rope_kv_bias_bf16": "PPPPiiifPPPPPiiiP",   # + the biases
                                            "gemv_prenormed_bf16": "PPPPiiifiP",        # the LM head
                                            "gemv_prenormed_silu_mul_bf16": "PPPPiiif",
                                            "gemv_prenormed_gelu_mul_bf16": "PPPPiiif"}
    assert kernel_signatures("token_mask.cu") == {"apply_token_mask": "PiPPii"}
    quant = kernel_signatures("gemv_quant.cu")      # one family per role: gemv_quant_<role>_##K
    assert quant["^gemv_quant_\\w+$"] == "PPPPiiiii"     # y, x, the weight's two planes, m n k, out_f32, accumulate
    assert quant["^dequant_\\w+$"] == "PPPiii"
    for bf16_kernel, sig in kernel_signatures("gemv.cu").items():   # each gemv.cu kernel's namesake: w as two planes
        w_at = [p.split()[-1] for p in kernel_parameters("gemv.cu")[bf16_kernel]].index("w")
        family = "^" + bf16_kernel.replace("gemv_", "gemv_quant_", 1).replace("_bf16", "_\\w+$")
        assert quant[family] == sig[:w_at + 1] + "P" + sig[w_at + 1:], family
    (full, sig), (window, window_sig) = kernel_signatures("attention_decode.cu").items()   # macro-made families
    # out, the split workspace and counters, lse_out, q, q_row_stride, the paged inputs, first_position, ...
    assert re.match(full, "attention_decode_d64_g4") and sig == "PPPPPPiPPPPPPiif"
    assert re.match(window, "attention_decode_window_d256_g4") and window_sig == sig + "i"    # + the window
    assert not re.match(full, "attention_decode_window_d64_g4")
    (full, sig), (window, window_sig) = kernel_signatures("attention_prefill.cu").items()
    assert re.match(full, "attention_prefill_d256") and window_sig == sig + "i" and sig == "PPiPPPPPPiiif"
    # out, lse, the split partials (o, ml) and counters, q, q_row_stride, k, v, block_tables, prefix_len,
    # num_seqs, block_size, kv heads, group, scale
    [(cascade, cascade_sig)] = kernel_signatures("attention_cascade.cu").items()
    assert re.match(cascade, "attention_cascade_prefix_d128") and cascade_sig == "PPPPPPiPPPPiiiif"


def test_attention_instantiations_are_read_from_the_sources():
    """The head shapes the model may ask for are the .cu files' instantiation lines."""
    assert {(64, 4), (128, 8), (64, 7), (256, 4)} <= ops.DECODE_SHAPES and (256, 3) not in ops.DECODE_SHAPES
    assert ops.PREFILL_HEAD_DIMS == (64, 128, 256) and ops.CASCADE_HEAD_DIMS == (64, 128, 256)
    assert ops.attention_kernels_missing(128, 32, 8) is None
    assert "head_dim 96 with 4 query heads" in ops.attention_kernels_missing(96, 32, 8)


def test_constants_are_read_with_their_dependencies():
    decode = kernel_constants("attention_decode.cu")
    assert decode["WARPS"] == decode["THREADS"] // 32
    prefill = kernel_constants("attention_prefill.cu")     # 16 query rows (one mma M) per warp
    assert prefill["THREADS"] == 32 * prefill["WARPS"] and prefill["BLOCK_Q"] == 16 * prefill["WARPS"]
    assert kernel_constants("sampling.cu")["NUM_WARPS"] == kernel_constants("sampling.cu")["SAMPLE_THREADS"] // 32
    for table, names in ((ops.EMBEDDING, ["THREADS"]), (ops.RMS_NORM, ["THREADS"]), (ops.ROPE, ["THREADS"]),
                         (ops.SILU, ["THREADS"]), (ops.PREFILL, ["BLOCK_Q", "THREADS"]), (ops.DECODE, ["THREADS"]),
                         (ops.CASCADE, ["BLOCK_Q", "THREADS", "TILE_K", "WIDE_TILE_K", "WIDE_HEAD_DIM", "STAGES",
                                        "ROW_PAD", "MAX_SPLITS", "MIN_SPLIT_KEYS"]),
                         (ops.GEMV, ["ROWS_PER_CTA", "STEP_K", "RING_STEPS", "RING_BYTES_PER_WARP", "MAX_K_WARPS"]),
                         (ops.SAMPLING, ["SAMPLE_THREADS", "EDIT_THREADS", "EDIT_WORDS", "MAX_TOP_LOGPROBS"])):
        for name in names:
            assert isinstance(table[name], int) and table[name] > 0, name


def test_every_kernel_has_a_launcher():
    """Every kernel's name appears in the source of a launcher family GpuOps is made of, or in
    QuantGemvOps.KERNELS (the quantized kinds' kernels, named by their namesake rule)."""
    launcher_source = "".join(inspect.getsource(family) for family in ops.GpuOps.__mro__[1:-1])
    by_rule = {name for kinds in ops.QuantGemvOps.KERNELS.values() for name in kinds.values()}
    for path in sorted(CUDA_DIR.glob("*.cu")):
        for name in kernel_signatures(path.name):
            stem = name.strip("^$").split("_d\\w+")[0]       # attention_decode_d\w+_g\w+ -> attention_decode
            assert f'"{stem}' in launcher_source or any(matches(name, n) for n in by_rule), \
                f"{path.name}: kernel {name} has no launcher in gpu/ops/"


def test_sampler_constants_agree_with_the_host_side():
    from tinyvllm.engine.logit_edits import EDIT_WORDS
    from tinyvllm.engine.sampling_params import MAX_LOGPROBS
    assert ops.SAMPLING["EDIT_WORDS"] == EDIT_WORDS
    assert ops.SAMPLING["MAX_TOP_LOGPROBS"] == MAX_LOGPROBS


def test_launch_attributes_reach_the_driver_in_cuda_h_layout(monkeypatch):
    """Kernel.launch's attributes as cuLaunchKernelEx reads them (a fake libcuda records the
    CUlaunchConfig): PDL only when asked and only for a PDL-capable kernel, its flag in the
    union's first word, 72-byte attributes (cuda.h: id, padding, a 64-byte union); a failed
    launch is one error naming the kernel and its grid."""
    import ctypes

    from tinyvllm.gpu import driver, kernels
    assert ctypes.sizeof(driver.LaunchAttribute) == 72
    seen = []

    class FakeCuda:
        def cuLaunchKernelEx(self, config, handle, params, extra):
            c = config._obj
            seen.append(([(c.attrs[i].id, tuple(c.attrs[i].value)) for i in range(c.num_attrs)],
                         ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0]))
            return 0 if config._obj.grid[0] else 1      # an empty grid fails, as CUDA's does

        def cuGetErrorString(self, status, message):
            message._obj.value = b"invalid argument"
            return 0

    monkeypatch.setattr(driver, "libcuda", lambda: FakeCuda())
    pdl = driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    capable, plain = (kernels.Kernel("k", ctypes.c_void_p(1), "Pi", c) for c in (True, False))
    for kernel, options, attrs in ((capable, {"pdl": True}, [(pdl, (1, 0, 0))]),
                                   (plain, {"pdl": True}, []),
                                   (capable, {"pdl": False}, []),
                                   (capable, {}, [])):
        kernel.launch((8, 1, 1), (32, 1, 1), 0, (5, -3), **options)
        assert seen.pop() == (attrs, -3)
    with pytest.raises(driver.CudaDriverError, match=r"launch of k grid \(0, 1, 1\) block \(32, 1, 1\) "
                                                     r"failed: invalid argument \(CUresult 1\)"):
        capable.launch((0, 1, 1), (32, 1, 1), 0, (5, -3), pdl=True)


def test_launch_packs_each_argument_at_its_own_pointer(monkeypatch):
    """Kernel.launch packs the arguments into one buffer: each params[i] must point at argument i
    in its C type (pointer, int, unsigned, float, uint64), aligned as the C parameter would be;
    arena views pass as pointers; a wrong value is a TypeError naming the kernel."""
    import ctypes

    from tinyvllm.gpu import driver, kernels
    seen = []
    ctypes_of = {"P": ctypes.c_void_p, "i": ctypes.c_int32, "I": ctypes.c_uint32, "f": ctypes.c_float,
                 "Q": ctypes.c_uint64}

    class FakeCuda:
        def cuLaunchKernelEx(self, config, handle, params, extra):
            seen.append([ctypes.cast(params[i], ctypes.POINTER(ctypes_of[c]))[0] for i, c in enumerate(signature)])
            assert all(params[i] % ctypes.sizeof(ctypes_of[c]) == 0 for i, c in enumerate(signature))
            return 0

    class View:
        def __index__(self):
            return 0x7F00_0000_1230

    monkeypatch.setattr(driver, "libcuda", lambda: FakeCuda())
    signature = "PiIfPQfiP"
    kernel = kernels.Kernel("k", ctypes.c_void_p(1), signature, True)
    args = (View(), -7, 2**32 - 1, 0.375, 0x1000, 2**64 - 1, -2.5, 2**31 - 1, 0)
    kernel.launch((1, 1, 1), (32, 1, 1), 0, args)
    kernel.launch((1, 1, 1), (32, 1, 1), 0, args[:4] + (0x2000,) + args[5:])   # the buffer is reused
    expected = [0x7F00_0000_1230, -7, 2**32 - 1, 0.375, 0x1000, 2**64 - 1, -2.5, 2**31 - 1, None]
    assert seen[0] == expected and seen[1] == expected[:4] + [0x2000] + expected[5:]
    with pytest.raises(TypeError, match="kernel k"):
        kernel.launch((1, 1, 1), (32, 1, 1), 0, args[:1] + (2**31,) + args[2:])
