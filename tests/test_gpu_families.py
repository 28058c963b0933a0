"""The kernels the model families add to Llama's, against their numpy twins in
reference/kernels.py through the launchers the model calls, on fresh random inputs with the
outputs poisoned first (test_gpu_attention_families.py has the attention kernels):

  * rope_write_kv_bias (Qwen2): every value bf16(qkv + bias) (one fp32 add of two bf16 values,
    rounded: the twin's bf16_round(qkv + bias) bit for bit), then RoPE as rope_write_kv; v in the
    cache must equal bf16(v + b) exactly; q and k within BF16_TOL of apply_rope of those values
    (test_gpu_kernels' rope tolerance: the same rotation).
  * rope_write_kv_qk_norm (Qwen3; Gemma 3 with weight_offset 1): each head bf16(rms_norm(x, w,
    eps, offset)) then RoPE. The kernel's sum of squares runs in another order and its inv_rms is
    rsqrtf, so a normalised value may round to the neighbouring bf16 (2^-8 relative) where the
    twin's lies near a rounding boundary; rotated and stored in bf16 (2^-9 relative each), q and
    k stay within BF16_TOL = 1e-2 relative (Frobenius); v is copied exactly.
  * gemv_prenormed_rope_kv_bias_bf16 (Qwen2's fused decode qkv): bitwise the chain
    gemv_prenormed_bf16 then rope_write_kv_bias (the same dot products, the same bias add and
    RoPE arithmetic): q in place and the K/V cache; nothing written past row m or into a slot no
    row names.
Gemma 3's (weight_offset 1: x * (1 + w), the sum in fp32):
  * rms_norm_offset: within BF16_TOL of rms_norm(x, w, eps, 1) (test_gpu_kernels' rms_norm bound).
  * rms_norm_residual_add: h' = bf16(h + bf16(rms_norm(x))). The normalised value y may round to
    the neighbouring bf16 of the twin's (one ulp: at most 2^-7 |y| relative), and the add rounds
    once (half an ulp of h', at most 2^-8 |h'|): |h'_gpu - h'_twin| <= 2^-7 |y| + 2^-8 (|h'_gpu| +
    |h'_twin|). Handing the next norm over: normed = bf16(h' * (1 + w_next)) bitwise (the fp32
    product rounded, then the bf16 store: the twin rms_norm_operand(weight_offset=1)), and each 16
    columns' sum of squares within 4 u of float64; a guard row past the rows keeps its poison.
  * gelu_tanh_mul: within BF16_TOL of the twin (fast exp and division: a few fp32 ulps, below the
    output's bf16 rounding); gemv_prenormed_gelu_mul_bf16 bitwise its chain gemv_prenormed_bf16
    then gelu_tanh_mul (common.cuh's gelu_tanh_times on both sides).
  * embedding_gather_scaled: out = bf16(E[id] * scale) bitwise (a bf16 times bf16(sqrt(hidden)):
    an exact fp32 product, one rounding), and its handed-over norm as rms_norm_residual_add's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyvllm.reference import kernels as ref

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2
EPS = 1e-6


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _freqs(d: int):
    from tinyvllm.checkpoint.model_writer import preset_config
    from tinyvllm.rope import rope_inv_freq
    return rope_inv_freq(dataclasses.replace(preset_config("llama-3.2-1b"), head_dim=d))


def _rope_case(rng, T, hq, hkv, d, num_slots):
    """Random qkv rows [T, (hq + 2 hkv) d], positions, slots (two padding rows: -1) and poisoned
    caches. -> (qkv, positions, slots, device inputs [positions, slots, freqs], caches, freqs)."""
    from gpu_helpers import BF16, DeviceArray, to_bf16
    qkv = to_bf16(rng.standard_normal((T, (hq + 2 * hkv) * d)) * rng.uniform(0.5, 4))
    positions = rng.integers(0, 131072, T).astype(np.int32)
    slots = rng.permutation(num_slots)[:T].astype(np.int32)
    slots[[1, T - 2]] = -1
    freqs = _freqs(d)
    caches = [DeviceArray.poisoned((num_slots, hkv, d), BF16) for _ in range(2)]
    return qkv, positions, slots, [DeviceArray(a) for a in (positions, slots, freqs)], caches, freqs


def _check_rope_outputs(got_qkv, caches, q, k, v, positions, slots, freqs, hq, exact_v=True):
    """q in place and the caches against the twin's rotation of q, k and the twin's v."""
    from gpu_helpers import rel_err
    d = q.shape[-1]
    assert rel_err(got_qkv[:, :hq * d].reshape(q.shape), ref.apply_rope(q, positions, freqs)) < BF16_TOL
    k_cache, v_cache = (c.get().astype(np.float32) for c in caches)
    live = slots >= 0
    assert rel_err(k_cache[slots[live]], ref.apply_rope(k, positions, freqs)[live]) < BF16_TOL
    if exact_v:
        np.testing.assert_array_equal(v_cache[slots[live]], v[live])
    unused = np.ones(len(k_cache), bool)
    unused[slots[live]] = False
    assert np.isnan(k_cache[unused]).all() and np.isnan(v_cache[unused]).all(), "wrote outside slot_mapping"


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (28, 4, 128), (4, 1, 64)])
def test_rope_write_kv_bias(gpu, rng, hq, hkv, d):
    from gpu_helpers import DeviceArray, to_bf16
    T = 37
    qkv, positions, slots, inputs, caches, freqs = _rope_case(rng, T, hq, hkv, d, 64)
    bias = to_bf16(rng.standard_normal(qkv.shape[1]) * 3)
    d_qkv, d_bias = DeviceArray(qkv), DeviceArray(bias)
    gpu.rope_write_kv(d_qkv, *caches, *inputs, T, hq, hkv, d, bias=d_bias)
    _sync()
    x = ref.bf16_round(qkv.astype(np.float32) + bias.astype(np.float32))      # the kernel's rounding, bitwise
    q, k, v = np.split(x, [hq * d, (hq + hkv) * d], axis=1)
    _check_rope_outputs(d_qkv.get(), caches, q.reshape(T, hq, d), k.reshape(T, hkv, d), v.reshape(T, hkv, d),
                        positions, slots, freqs, hq)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (4, 1, 256), (4, 2, 64), (8, 4, 256)])
def test_rope_write_kv_qk_norm(gpu, rng, hq, hkv, d, weight_offset):
    from gpu_helpers import DeviceArray, to_bf16
    T = 29
    qkv, positions, slots, inputs, caches, freqs = _rope_case(rng, T, hq, hkv, d, 48)
    centre = 1.0 - weight_offset                                               # Gemma's weights sit near 0
    q_w, k_w = (to_bf16(centre + 0.3 * rng.standard_normal(d)) for _ in range(2))
    d_qkv = DeviceArray(qkv)
    keep = [DeviceArray(w) for w in (q_w, k_w)]
    gpu.rope_write_kv(d_qkv, *caches, *inputs, T, hq, hkv, d, qk_norm=(keep[0], keep[1], EPS, weight_offset))
    _sync()
    q, k, v = np.split(qkv.astype(np.float32), [hq * d, (hq + hkv) * d], axis=1)
    q = ref.bf16_round(ref.rms_norm(q.reshape(T, hq, d), q_w, EPS, weight_offset))
    k = ref.bf16_round(ref.rms_norm(k.reshape(T, hkv, d), k_w, EPS, weight_offset))
    _check_rope_outputs(d_qkv.get(), caches, q, k, v.reshape(T, hkv, d), positions, slots, freqs, hq)


def test_rope_write_kv_rejects_bias_with_qk_norm(gpu):
    with pytest.raises(ValueError, match="biases and q/k norms"):
        gpu.rope_write_kv(0, 0, 0, 0, 0, 0, 1, 2, 1, 64, bias=16, qk_norm=(16, 16, EPS, 0.0))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k_warps", [None, 3])
@pytest.mark.parametrize("k,hq,hkv,d", [(896, 14, 2, 64), (256, 4, 1, 64), (1536, 12, 2, 128)])
def test_gemv_rope_kv_bias_equals_its_chain(gpu, rng, k, hq, hkv, d, m, k_warps):
    from gpu_helpers import BF16, DeviceArray, to_bf16
    from test_gpu_fused import _bits, _handed_over, _weights
    _, _, normed, row_ss = _handed_over(gpu, rng, m, k, k_warps)
    n = (hq + 2 * hkv) * d
    _, d_w = _weights(rng, n, k)
    bias = DeviceArray(to_bf16(rng.standard_normal(n)))
    positions = rng.integers(0, 131072, m).astype(np.int32)
    slots = rng.permutation(64)[:m].astype(np.int32)
    if m > 1:
        slots[1] = -1
    rope_in = [DeviceArray(a) for a in (positions, slots, _freqs(d))]
    out = {}
    for path in ("fused", "chain"):
        qkv = DeviceArray.poisoned((m + 1, n), BF16)
        caches = [DeviceArray.poisoned((64, hkv, d), BF16) for _ in range(2)]
        if path == "fused":
            gpu.gemv_rope_kv(qkv, normed, d_w, m, n, k, *caches, *rope_in, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=d, prenormed=(row_ss, 1e-5), k_warps=k_warps, bias=bias)
        else:
            gpu.gemv(qkv, normed, d_w, m, n, k, prenormed=(row_ss, 1e-5), k_warps=k_warps)
            gpu.rope_write_kv(qkv, *caches, *rope_in, m, hq, hkv, d, bias=bias)
        _sync()
        out[path] = [qkv.get(), *(c.get() for c in caches)]
    (fused_qkv, *fused_caches), (chain_qkv, *chain_caches) = out["fused"], out["chain"]
    np.testing.assert_array_equal(_bits(fused_qkv[:, :hq * d]), _bits(chain_qkv[:, :hq * d]), err_msg="q")
    for name, a, b in zip(("k cache", "v cache"), fused_caches, chain_caches):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
    assert np.all(_bits(fused_qkv[m]) == 0x7FC0), "wrote past row m"
    assert not np.any(_bits(fused_caches[0])[slots[slots >= 0]] == 0x7FC0), "a row's k not written"


U = 2.0 ** -24


def _offset_weight(rng, k):
    """A Gemma norm weight (near 0: the model multiplies by 1 + w) with NaN guards after it."""
    from gpu_helpers import DeviceArray, to_bf16
    w = to_bf16(0.3 * rng.standard_normal(k))
    return w, DeviceArray(np.concatenate([w, np.full(8, np.nan, np.float32).astype(w.dtype)]))


def _check_hand_over(normed, row_ss, rows, hidden, next_w):
    """normed = bf16(hidden * (1 + next_w)) bitwise, row sums within 4 u, guard row poisoned."""
    from test_gpu_fused import _bits
    got_normed, got_ss = normed.get(), row_ss.get()
    np.testing.assert_array_equal(got_normed[:rows].astype(np.float32), ref.rms_norm_operand(hidden, next_w, 1.0))
    exact = (hidden.astype(np.float64) ** 2).reshape(rows, -1, 16).sum(-1)
    assert np.all(np.abs(got_ss[:rows] - exact) <= 4 * U * exact + 1e-30), "row sums of squares"
    assert np.all(_bits(got_normed[rows]) == 0x7FC0) and np.all(_bits(got_ss[rows]) == 0x7FC00000), "wrote past the rows"


@pytest.mark.parametrize("hidden", [128, 1152, 2560])
def test_rms_norm_offset(gpu, rng, hidden):
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    T = 21
    x = to_bf16(rng.standard_normal((T, hidden)) * 3)
    w, d_w = _offset_weight(rng, hidden)
    out = DeviceArray.poisoned((T, hidden), x.dtype)
    d_x = DeviceArray(x)
    gpu.rms_norm(out, d_x, d_w, T, hidden, EPS, weight_offset=1.0)
    _sync()
    assert rel_err(out.get(), ref.rms_norm(x, w, EPS, 1.0)) < BF16_TOL


@pytest.mark.parametrize("hand_over", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 128), (5, 1152), (37, 2560)])
def test_rms_norm_residual_add(gpu, rng, rows, hidden, hand_over):
    from gpu_helpers import BF16, DeviceArray, rel_err, to_bf16
    h0 = to_bf16(rng.standard_normal((rows, hidden)) * rng.uniform(0.5, 20))
    x = to_bf16(rng.standard_normal((rows, hidden)) * rng.uniform(0.01, 50))
    w, d_w = _offset_weight(rng, hidden)
    next_w, d_next = _offset_weight(rng, hidden)
    d_h, d_x = DeviceArray(h0), DeviceArray(x)
    normed = DeviceArray.poisoned((rows + 1, hidden), BF16)
    row_ss = DeviceArray.poisoned((rows + 1, hidden // 16), np.float32)
    gpu.rms_norm_residual_add(d_h, d_x, d_w, rows, hidden, EPS, 1.0,
                              hand_over=(d_next, normed, row_ss) if hand_over else None)
    _sync()
    got = d_h.get().astype(np.float64)
    y = ref.bf16_round(ref.rms_norm(x, w, EPS, 1.0)).astype(np.float64)
    want = ref.bf16_round(h0.astype(np.float32) + y).astype(np.float64)
    bound = 2.0 ** -7 * np.abs(y) + 2.0 ** -8 * (np.abs(got) + np.abs(want))
    worst = float(np.max(np.abs(got - want) / np.maximum(bound, 1e-300)))
    print(f"[norm-residual] worst |gpu - twin| / bound = {worst:.3f}")
    assert np.all(np.isfinite(got)) and worst <= 1.0
    assert rel_err(got - h0.astype(np.float64), want - h0.astype(np.float64)) < BF16_TOL
    if hand_over:
        _check_hand_over(normed, row_ss, rows, d_h.get().astype(np.float32), next_w)
    else:
        assert np.all(np.isnan(normed.get().astype(np.float32))), "no hand-over asked: normed untouched"


def test_rms_norm_residual_add_rejects_a_hidden_size_it_cannot_chunk(gpu):
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu.rms_norm_residual_add(0, 0, 0, 1, 264, EPS, 1.0)


def test_gelu_tanh_mul(gpu, rng):
    from gpu_helpers import DeviceArray, rel_err, to_bf16
    T, inter = 19, 6912
    gate_up = to_bf16(rng.standard_normal((T, 2 * inter)) * 3)
    gate_up[0, :8] = np.array([-60, -20, -5, -1e-3, 0, 1e-3, 5, 30], np.float32)   # tails and the middle
    out = DeviceArray.poisoned((T, inter), gate_up.dtype)
    d_gate_up = DeviceArray(gate_up)
    gpu.silu_mul(out, d_gate_up, T, inter, gelu_tanh=True)
    _sync()
    assert rel_err(out.get(), ref.gelu_tanh_mul(gate_up[:, :inter], gate_up[:, inter:])) < BF16_TOL


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("k,inter", [(1152, 6912), (128, 320)])
def test_gemv_gelu_mul_equals_its_chain(gpu, rng, k, inter, m):
    from gpu_helpers import BF16, DeviceArray
    from test_gpu_fused import _bits, _handed_over, _weights
    _, _, normed, row_ss = _handed_over(gpu, rng, m, k, None)
    _, d_w = _weights(rng, 2 * inter, k)
    act, gate_up, chain = (DeviceArray.poisoned((m + 1, width), BF16) for width in (inter, 2 * inter, inter))
    gpu.gemv_silu_mul(act, normed, d_w, m, 2 * inter, k, prenormed=(row_ss, 1e-5), gelu_tanh=True)
    gpu.gemv(gate_up, normed, d_w, m, 2 * inter, k, prenormed=(row_ss, 1e-5))
    gpu.silu_mul(chain, gate_up, m, inter, gelu_tanh=True)
    _sync()
    got = act.get()
    np.testing.assert_array_equal(_bits(got), _bits(chain.get()), err_msg="gelu epilogue != its chain")
    assert np.all(_bits(got[m]) == 0x7FC0) and not np.any(_bits(got[:m]) == 0x7FC0)


@pytest.mark.parametrize("hand_over", [False, True])
def test_embedding_gather_scaled(gpu, rng, hand_over):
    from gpu_helpers import BF16, DeviceArray, to_bf16
    vocab, hidden, tokens = 5000, 1152, 9
    scale = float(ref.bf16_round(np.float32(hidden ** 0.5)))             # 33.94 -> 34.0 in bf16
    table = to_bf16(rng.standard_normal((vocab, hidden)) * 0.05)
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    ids[3] = vocab                                                        # out of range: a zero row
    next_w, d_next = _offset_weight(rng, hidden)
    normed = DeviceArray.poisoned((tokens + 1, hidden), BF16)
    row_ss = DeviceArray.poisoned((tokens + 1, hidden // 16), np.float32)
    out = DeviceArray.poisoned((tokens, hidden), BF16)
    keep = [DeviceArray(a) for a in (table, ids)]
    gpu.embedding(out, keep[0], keep[1], tokens, hidden, vocab, norm=(d_next, normed, row_ss) if hand_over else None,
                  scale=scale, norm_offset=1.0)
    _sync()
    want = ref.bf16_round(ref.embedding(ids, table) * np.float32(scale))
    got = out.get().astype(np.float32)
    np.testing.assert_array_equal(got, want)
    if hand_over:
        _check_hand_over(normed, row_ss, tokens, got, next_w)
