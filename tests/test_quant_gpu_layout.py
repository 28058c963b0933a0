"""The quantized weights' device layout, checked without a GPU: the planes gpu/quant_weights.py
packs read back (as cuda/gemv_quant.cu reads them) to each kind's twin bit for bit, the upload
plan of a quantized model (its bytes, the tied head's planes, the prefill scratch), and the
quantized GEMV's launch shapes within a CTA's shared memory."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.gpu.device_weights import device_host_tensors, device_weight_bytes
from tinyvllm.gpu.ops.quant_gemv import QuantGemvOps, quant_gemv_shape
from tinyvllm.gpu.quant_weights import QuantMatrix, fp8_scaled_bf16, pack_planes, planes_dequantize_bf16
from tinyvllm.quant import fp8
from tinyvllm.quant.block_format import BF16, QuantizedWeight
from tinyvllm.quant.gguf_legacy import Q4_0, Q4_1, Q8_0

gguf = pytest.importorskip("gguf")

from test_quant_gguf import random_raw  # noqa: E402


@pytest.mark.parametrize("fmt", [Q8_0, Q4_0, Q4_1], ids=lambda f: f.name)
@pytest.mark.parametrize("cols", [32, 96, 576])          # odd and even block counts per row
def test_block_planes_read_back_to_the_twin(fmt, cols):
    w = QuantizedWeight.from_raw(fmt, (19, cols), random_raw(fmt, 19, cols, cols), "w")
    kind, quants, scales = pack_planes(w)
    assert kind == fmt.name and quants.shape[1] % 16 == 0            # 16-byte aligned rows
    assert quants.nbytes + scales.nbytes <= w.nbytes + 2 * 19        # the blocks' bytes (+ odd-nb padding)
    got = planes_dequantize_bf16(kind, quants, scales, 19, cols)
    np.testing.assert_array_equal(got.view(np.uint16), w.dequantize_bf16().view(np.uint16))


def test_fp8_planes_are_the_codes_and_row_scales(rng):
    w = fp8.quantize_per_channel(rng.standard_normal((7, 48)).astype(np.float32))
    kind, codes, scales = pack_planes(w)
    assert kind == "FP8" and codes.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == (7,)
    np.testing.assert_array_equal(planes_dequantize_bf16(kind, codes, scales, 7, 48).astype(np.float32),
                                  w.codes.astype(np.float32))                       # codes exact in bf16
    np.testing.assert_array_equal(fp8_scaled_bf16(codes, scales, 7, 48).view(np.uint16),
                                  w.dequantize().astype(BF16).view(np.uint16))
    per_tensor = fp8.Fp8Weight(w.codes, np.float32(0.5).reshape(()))
    assert np.all(pack_planes(per_tensor)[2] == np.float32(0.5))
    with pytest.raises(ModelLoadError, match="multiple of 16"):
        pack_planes(fp8.quantize_per_channel(np.ones((2, 40), np.float32)))


def test_a_quantized_models_upload_plan(tmp_path, monkeypatch):
    """A tied Q4_1 GGUF model: every layer matrix as its planes, the embedding as its bf16 table
    for the gather plus its planes for the head, and a scratch of the largest layer matrix."""
    from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf

    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.checkpoint.weight_names import EMBED
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    hf = tiny_hf_config(len(tiny_vocab()[0]))
    path = write_gguf(tmp_path / "m.gguf", hf, tiny_hf_weights(hf), qtype="Q4_1")
    config = ModelConfig.from_pretrained(gguf_model_dir(path))
    weights = load_gguf_blocks(path, config)
    plan = device_host_tensors(config, weights)
    assert plan["0.gate_up"].kind == "Q4_1" and plan["0.gate_up"].shape == (2 * config.intermediate_size,
                                                                             config.hidden_size)
    np.testing.assert_array_equal(plan["embed"].arrays[0].view(np.uint16),
                                  weights[EMBED].dequantize_bf16().view(np.uint16))
    assert plan["lm_head"].kind == "Q4_1" and plan["lm_head"].shape == weights[EMBED].shape
    largest = max(plan[f"0.{p}"].shape[0] * plan[f"0.{p}"].shape[1] for p in ("qkv", "o", "gate_up", "down"))
    assert plan["dequant_scratch"].reserve == 2 * largest
    assert device_weight_bytes(config, weights) == sum(t.nbytes for t in plan.values())
    q4_1 = sum(t.arrays[0].nbytes + t.arrays[1].nbytes for t in plan.values() if t.kind)
    blocks = sum(w.nbytes for w in weights.values() if isinstance(w, QuantizedWeight))
    assert q4_1 == blocks      # every block once (the tied embedding's as the head's planes), plus the bf16 table


def test_launch_shapes_fit_shared_memory():
    ops = QuantGemvOps(None, num_sms=132)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (3072, 2048), (16384, 2048),
              (2048, 8192), (128256, 2048), (37, 96)]
    for kind in ("FP8", "Q8_0", "Q4_0", "Q4_1"):
        for n, k in shapes:
            kw = ops.quant_k_warps(QuantMatrix(kind, 0, 0, n, k, 0))
            grid, block, shared = quant_gemv_shape(kind, n, kw)
            assert 1 <= kw <= 16 and grid[0] * 16 >= n and shared <= 227 << 10, (kind, n, k, kw, shared)
