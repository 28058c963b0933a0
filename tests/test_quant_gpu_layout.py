"""The quantized weights' device layout, checked without a GPU: the planes gpu/quant_weights.py
packs read back (as cuda/gemv_quant.cu reads them: planes_dequantize_bf16, and for the GGUF kinds a
lane-by-lane emulation of the kernel's addressing) to each kind's twin bit for bit, the upload
plan of a quantized model (its bytes, the tied head's planes, the prefill scratch; a Q4_K_M-like
file's mixed q/k/v as one EXPANDED matrix), and the quantized GEMV's launch shapes within a CTA's
shared memory."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.gpu.device_weights import device_host_tensors, device_weight_bytes
from tinyvllm.gpu.ops.quant_gemv import LANE_K, QGEMV, QuantGemvOps, max_k_warps, quant_gemv_shape
from tinyvllm.gpu.quant_weights import EXPANDED, QuantMatrix, fp8_scaled_bf16, pack_planes, planes_dequantize_bf16
from tinyvllm.quant import fp8
from tinyvllm.quant.block_format import BF16, QuantizedWeight
from tinyvllm.quant.gguf_kquants import Q4_K, Q6_K
from tinyvllm.quant.gguf_legacy import Q4_0, Q4_1, Q8_0
from tinyvllm.quant.weight_kinds import RowStack, cuda_unsupported

gguf = pytest.importorskip("gguf")

from test_quant_gguf import random_raw  # noqa: E402

# device bits a weight over the file's (scales included): the legacy blocks as stored (+ odd-nb
# padding), the K-quants with their scales in fp32 and Q6_K's codes widened (gpu/quant_weights.py)
DEVICE_BITS = {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 6.0, "Q6_K": 10.0}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def lane_read_bf16(kind: str, quants: np.ndarray, scales: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """bf16 [rows, cols] read as cuda/gemv_quant.cu's lanes read the GGUF kinds: per step, lane t's 16
    bytes at k = kk + LANE_K * t (bytes k or k / 2 of the row), its scale word(s) at the kernel's
    index, its groups j = 0.. of 8 weights (nibble kinds: low nibbles of bytes 0..7 and 8..15, then
    the high nibbles) dequantized with the kernel's formula, written at the k the mma pairs them with."""
    out = np.zeros((rows, cols), np.float32)
    lane_k = LANE_K[kind]
    q_rows = np.asarray(quants, np.uint8).reshape(rows, -1)
    words = np.asarray(scales, np.uint8).reshape(rows, -1).view(np.uint32)
    f32, f16 = words.view(np.float32), words.view("<f2").astype(np.float32)
    for kc in range(0, cols, lane_k):                       # every lane chunk of every step
        chunk = q_rows[:, kc // 2:kc // 2 + 16] if lane_k == 32 else q_rows[:, kc:kc + 16]
        if kind == "Q4_K":
            a, b = f32[:, 2 * (kc // 32)], f32[:, 2 * (kc // 32) + 1]
        elif kind == "Q6_K":
            a, b = f32[:, kc // 16], None
        elif kind == EXPANDED:
            a, b = f32[:, 2 * (kc // 16)], f32[:, 2 * (kc // 16) + 1]
        elif kind == "Q4_1":
            a, b = f16[:, 2 * (kc // 32)], f16[:, 2 * (kc // 32) + 1]
        else:                                               # Q8_0, Q4_0: word kc / 64, half (kc / 32) & 1
            a, b = f16[:, 2 * (kc // 64) + (kc // 32) % 2], None
        for j in range(lane_k // 8):
            if lane_k == 32:
                byte = chunk[:, 8 * (j & 1):8 * (j & 1) + 8]
                q = ((byte >> 4) if j & 2 else (byte & 15)).astype(np.float32)
                if kind == "Q4_0":
                    q = q - np.float32(8)
            else:
                q = chunk[:, 8 * j:8 * j + 8].view(np.int8).astype(np.float32)
            value = a[:, None] * q                          # exact in every kind (the twins' step 2)
            out[:, kc + 8 * j:kc + 8 * j + 8] = value if b is None else np.float32(value + b[:, None])
    return out.astype(BF16)


@pytest.mark.parametrize("fmt,cols", [(f, c) for f in (Q8_0, Q4_0, Q4_1) for c in (32, 96, 576)] +
                         [(f, c) for f in (Q4_K, Q6_K) for c in (256, 1280)],   # odd and even block counts a row
                         ids=lambda v: getattr(v, "name", str(v)))
def test_block_planes_read_back_to_the_twin(fmt, cols):
    w = QuantizedWeight.from_raw(fmt, (19, cols), random_raw(fmt, 19, cols, cols), "w")
    kind, quants, scales = pack_planes(w)
    assert kind == fmt.name and quants.shape[1] % 16 == 0            # 16-byte aligned rows
    assert quants.nbytes + scales.nbytes <= 19 * cols * DEVICE_BITS[kind] / 8 + 2 * 19
    twin = _bits(w.dequantize_bf16())
    np.testing.assert_array_equal(_bits(planes_dequantize_bf16(kind, quants, scales, 19, cols)), twin)
    np.testing.assert_array_equal(_bits(lane_read_bf16(kind, quants, scales, 19, cols)), twin)


@pytest.mark.parametrize("formats", [(Q4_K, Q4_K, Q6_K), (Q6_K, Q4_K), (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)],
                         ids=lambda fs: "+".join(f.name for f in fs))
def test_mixed_group_expands_to_the_parts_twins(formats):
    """A fused group of GGUF blocks in different formats (a Q4_K_M file's q/k/v with v in Q6_K)
    uploads as one EXPANDED matrix, w = fl32(a * q + b) per 16 weights, that reads back to each
    part's twin bit for bit (zero's sign included) and is not refused on CUDA."""
    parts = tuple(QuantizedWeight.from_raw(f, (16 * (i + 1), 512), random_raw(f, 16 * (i + 1), 512, i), "w")
                  for i, f in enumerate(formats))
    stack = RowStack(parts)
    rows = stack.shape[0]
    kind, quants, scales = pack_planes(stack)
    assert kind == EXPANDED and quants.shape == (rows, 512) and scales.shape == (rows, 512 // 16 * 8)
    twin = _bits(np.concatenate([p.dequantize_bf16() for p in parts]))
    np.testing.assert_array_equal(_bits(planes_dequantize_bf16(kind, quants, scales, rows, 512)), twin)
    np.testing.assert_array_equal(_bits(lane_read_bf16(kind, quants, scales, rows, 512)), twin)
    assert cuda_unsupported({"qkv": stack}) is None


def test_a_group_mixing_blocks_with_other_kinds_is_refused():
    q4_k = QuantizedWeight.from_raw(Q4_K, (2, 256), random_raw(Q4_K, 2, 256, 0), "k")
    mixed = RowStack((np.ones((2, 256), np.float32), q4_k))
    assert cuda_unsupported({"m": mixed}) == "F32+Q4_K (a fused group mixing blocks with other kinds)"
    with pytest.raises(ModelLoadError, match="fused groups of GGUF blocks, not F32\\+Q4_K"):
        pack_planes(mixed)


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


Q4_K_M_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                   "token_embd", "output")


def q4_k_m_format(gguf_name: str):
    """A Q4_K_M file's choice, in small: Q4_K everywhere but the output, layer 0's attn_v and
    ffn_down (Q6_K)."""
    if gguf_name == "output.weight" or gguf_name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return Q6_K
    return Q4_K


def tame_raw(fmt, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of `fmt` whose weights stay within about +-0.1 (random quants, sub-block
    scales and mins; fp16 super-block factors sized for them): a model on them stays finite."""
    raw = random_raw(fmt, rows, cols, int(rng.integers(1 << 31))).reshape(-1, fmt.block_bytes)
    largest = {"Q4_K": 63 * 15, "Q6_K": 128 * 32}[fmt.name]           # |sc * code| at most
    for offset in fmt.fp16_fields:
        values = rng.uniform(0.2, 1.0, len(raw)) * rng.choice([-1.0, 1.0], len(raw)) * 0.1 / largest
        raw[:, offset:offset + 2] = values.astype("<f2").reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def write_q4_k_m_gguf(path, seed: int = 0):
    """A tiny untied Llama GGUF file laid out as a Q4_K_M one (q4_k_m_format), rows of 256 and 512
    weights (whole super-blocks), head_dim 64; its blocks random (tame_raw). Returns the path."""
    import gguf
    from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf

    from tinyvllm.checkpoint.gguf import gguf_name_of
    from tinyvllm.checkpoint.weight_names import expected_shapes
    rng = np.random.default_rng(seed)
    hf = tiny_hf_config(len(tiny_vocab()[0]), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
    extra = {}
    for name, shape in expected_shapes(ModelConfig.from_dict(hf)).items():
        if len(shape) != 2:
            continue
        gname = gguf_name_of(name)
        fmt = q4_k_m_format(gname)
        extra[gname] = (tame_raw(fmt, *shape, rng), gguf.GGMLQuantizationType[fmt.name])
    return write_gguf(path, hf, tiny_hf_weights(hf, seed), drop=Q4_K_M_MATRICES, extra_tensors=extra)


def test_a_q4_k_m_files_upload_plan(tmp_path, monkeypatch):
    """Layer 0's q/k/v (Q4_K, Q4_K, Q6_K) uploads as one EXPANDED matrix reading back to its parts'
    twins; layer 1's as Q4_K; the Q6_K downs and head as Q6_K; the Q4_K embedding as its bf16 table."""
    from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, load_gguf_blocks
    from tinyvllm.checkpoint.weight_names import EMBED, fused_layer
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    path = write_q4_k_m_gguf(tmp_path / "m.gguf")
    config = ModelConfig.from_pretrained(gguf_model_dir(path))
    weights = load_gguf_blocks(path, config)
    assert cuda_unsupported(weights) is None
    plan = device_host_tensors(config, weights)
    kinds = {key: t.kind for key, t in plan.items() if t.kind}
    assert kinds == {"0.qkv": EXPANDED, "0.o": "Q4_K", "0.gate_up": "Q4_K", "0.down": "Q6_K", "1.qkv": "Q4_K",
                     "1.o": "Q4_K", "1.gate_up": "Q4_K", "1.down": "Q4_K", "lm_head": "Q6_K"}
    qkv = plan["0.qkv"]
    np.testing.assert_array_equal(_bits(planes_dequantize_bf16(EXPANDED, *qkv.arrays, *qkv.shape)),
                                  _bits(np.concatenate([p.dequantize_bf16() for p in fused_layer(weights, 0, "qkv", config).parts])))
    np.testing.assert_array_equal(_bits(plan["embed"].arrays[0]), _bits(weights[EMBED].dequantize_bf16()))


def test_every_kind_has_each_kernel_with_its_q4_1_namesakes_arguments():
    """QuantGemvOps.KERNELS names, for every kind, a kernel of cuda/gemv_quant.cu that the library
    finds by its own role's family (gemv_quant_<role>_##K, never a shorter family's pattern that
    also matches its name) taking what its Q4_1 namesake takes."""
    from tinyvllm.gpu.kernels import find_kernel, kernel_signatures
    signatures = kernel_signatures("gemv_quant.cu")
    for kind, kernels in QuantGemvOps.KERNELS.items():
        assert set(kernels) == set(QuantGemvOps.KERNELS["Q4_1"]), kind
        for role, name in kernels.items():
            filename, key = find_kernel(name)
            assert filename == "gemv_quant.cu" and key == "^" + name.removesuffix(kind.lower()) + "\\w+$", (kind, role)
            assert signatures[key] == signatures[find_kernel(QuantGemvOps.KERNELS["Q4_1"][role])[1]], (kind, role)


def test_launch_shapes_fit_shared_memory():
    ops = QuantGemvOps(None, num_sms=132)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (3072, 2048), (16384, 2048),
              (2048, 8192), (128256, 2048), (37, 96)]
    assert set(LANE_K) == {"FP8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", EXPANDED}
    assert QGEMV["SLOT_BYTES_Q4_K"] >= 32 * 16 * 6 + 2 * 32 * 8      # 2 W + 4 X quads, 2 rows' fp32 pairs
    assert QGEMV["SLOT_BYTES_EXPANDED"] >= 32 * 16 * 4 + 2 * 32 * 8 and QGEMV["SLOT_BYTES_Q6_K"] >= 32 * 16 * 4 + 2 * 32 * 4
    for kind in LANE_K:
        for n, k in shapes:
            kw = ops.quant_k_warps(QuantMatrix(kind, 0, 0, n, k, 0))
            grid, block, shared = quant_gemv_shape(kind, n, kw)
            # the rings, and a prenormed kernel's row sums at m = 8 (2k bytes), within one block's opt-in
            assert 1 <= kw <= max_k_warps(kind) and grid[0] * 16 >= n and shared + 2 * k <= 227 << 10, \
                (kind, n, k, kw, shared)
    assert max_k_warps("FP8") == 32 and ops.quant_k_warps(QuantMatrix("FP8", 0, 0, 2048, 8192, 0)) == 32
