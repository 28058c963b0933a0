"""The fused decode layer's GEMVs (cuda/gemv.cu: gemv_residual_norm_bf16 and the embedding
gather handing an RMSNorm over, gemv_prenormed_rope_kv_bf16, gemv_prenormed_silu_mul_bf16,
gemv_prenormed_bf16) against their numpy twins and against the unfused kernels.

1. The handed-over operand: gemv_residual_norm's y += X @ W^T equals gemv()'s with accumulate at
   the same k-split (bitwise: the same dot products), the embedding's rows the plain gather's;
   normed = bf16(y * norm_w) bitwise (one fp32 product, one rounding), the row sums of squares of
   each 16 columns within 4 u of float64 (_handed_over).
2. Bitwise against the chains: gemv_prenormed_rope_kv equals gemv_prenormed_bf16 (bf16 Y, the
   same k-split: each output's dot product and scale are the same code) then rope_write_kv();
   gemv_prenormed_silu_mul equals gemv_prenormed_bf16 then silu_mul() (common.cuh gives both
   sides the RoPE and SwiGLU arithmetic).
3. Against the numpy twin reference/kernels.py rms_norm_linear, P_t = fl(r_t fl(sum_k a_k w_k)),
   a = bf16(x * norm_w) (the same bf16 operand on both sides: the product of two bf16 values is
   exact in fp32). The GPU differs only in fp32 order and its fast inv_rms. With u = 2^-24,
   S = |a| @ |W|^T and r* the exact inv_rms (float64):
     - the two fp32 sums of the same k products: each within g_k S of the exact, g_k = k u / (1 - k u);
     - inv_rms: the twin's within rho_t = ((k + 3) / 2 + 2) u of r* (test_reference_fused.py), the
       GPU's (fp32 sums of squares in its order: k u, halved by the root; __fdividef 2 ulp and the
       eps add, halved; rsqrtf 2^-22.9 < 4 u) within rho_g = ((k + 3) / 2 + 4) u;
     - the final multiplies: u each.
   |P_g - P_t| <= delta = 1.001 r* S (2 g_k + rho_t + rho_g + 2 u)   (|sum| <= S).
   The kernel rounds P_g to bf16 (2^-8 relative, of the rounded value) before its epilogue:
     Delta = delta + 2^-8 (|P_t| + delta).
   silu epilogue: act = bf16(silu(G) U) with |G - g|, |U - u| <= Delta_g, Delta_u (g, u the twin's
   gate and up): silu is 1.1-Lipschitz and |silu(G)| <= |G|, so |silu(G) U - silu(g) u| <=
   (|g| + Delta_g) Delta_u + 1.1 |u| Delta_g; silu_times' fp32 error is below 2^-19 relative and
   the final rounding 2^-8 |act|. Compared with silu(g) u in float64.
   RoPE epilogue: k and v as stored in qkv, and v in the cache, are bf16(P_g): within Delta of P_t.
   q (in place) and k in the cache are a rotation of the bf16 pair (|cos|, |sin| <= 1: the input
   errors add, Delta_1 + Delta_2) by the fp32 angle fl(pos inv_freq) (rounding <= u pos inv_freq
   radians, sincosf's error < 2^-21 absolute: (|x1| + |x2|) times their sum), three fp32 roundings
   of the rotation (3 u (|x1| + |x2|)) and the bf16 store (2^-8 |y|). Compared with the float64
   rotation of the twin's pair by the float64 angle pos * inv_freq.
4. Nothing written outside the outputs: outputs and caches start poisoned, guard rows / unused
   cache slots / a padding row's slot (-1) must keep their bits; inputs carry NaN past their
   valid rows.
Inputs are drawn fresh each run (seeds printed by the rng fixture).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyvllm.reference import kernels as ref

pytestmark = pytest.mark.gpu

EPS = 1e-5
U = 2.0 ** -24


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _with_nan_rows(a: np.ndarray, rows: int = 1) -> np.ndarray:
    from gpu_helpers import BF16
    return np.concatenate([a, np.full((rows, *a.shape[1:]), np.nan, np.float32).astype(BF16)])


def _norm_twin(stored, norm_w, w32):
    """(P_t float64, Delta: the bound on |bf16(P_g) - P_t|) of the module docstring, item 3."""
    k = stored.shape[-1]
    x64 = stored.astype(np.float64)
    r_exact = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
    s = np.abs(ref.rms_norm_operand(stored, norm_w).astype(np.float64)) @ np.abs(w32.astype(np.float64)).T
    gamma = k * U / (1 - k * U)
    delta = 1.001 * r_exact * s * (2 * gamma + ((k + 3) / 2 + 2) * U + ((k + 3) / 2 + 4) * U + 2 * U)
    twin = ref.rms_norm_linear(stored, norm_w, w32, EPS).astype(np.float64)
    return twin, delta + 2.0 ** -8 * (np.abs(twin) + delta)


def _within(got, want, bound, what):
    got = got.astype(np.float64)
    assert np.all(np.isfinite(got)), f"{what}: NaN / inf (unwritten poison?)"
    worst = float(np.max(np.abs(got - want) / np.maximum(bound, 1e-300)))
    print(f"[norm-twin] {what}: worst |gpu - twin| / bound = {worst:.3f}")
    assert worst <= 1.0, what


def _weights(rng, n, k):
    from gpu_helpers import DeviceArray, to_bf16
    w = to_bf16(rng.standard_normal((n, k)) / math.sqrt(k))
    return w.astype(np.float32), DeviceArray(_with_nan_rows(w, 16))


def _embedding_inputs(rng, m, k):
    """A 50-row table [50, k] and m ids into it for the embedding gather, the last of them out of
    range when m > 2 (a zero row: inv_rms = 1 / sqrt(eps), every product 0).
    -> (device table, device ids, vocab)."""
    from gpu_helpers import DeviceArray, to_bf16
    vocab = 50
    table = to_bf16(rng.standard_normal((vocab, k)) * rng.uniform(0.1, 30))
    ids = rng.integers(0, vocab, m).astype(np.int32)
    ids[-1] = vocab + 3 if m > 2 else ids[-1]
    return DeviceArray(table), DeviceArray(ids), vocab


def _norm_weight(rng, k):
    from gpu_helpers import DeviceArray, to_bf16
    norm_w = to_bf16(1 + 0.2 * rng.standard_normal(k))
    return norm_w, DeviceArray(np.concatenate([norm_w, np.full(8, np.nan, np.float32).astype(norm_w.dtype)]))


GUARD_KEY = 0x0123456789ABCDEF   # an argmax key no row of logits has (its low word is no index here)


def _handed_over(gpu, rng, m, k, k_warps, producer="gemv"):
    """gemv_residual_norm (the o / down GEMV handing the norm over) on a fresh residual stream,
    checked against gemv() with accumulate at the same k_warps (bitwise: the same dot products),
    or (producer "embedding") the embedding gather handing the first input norm over, checked
    against the plain gather (bitwise: a copy); then against bf16(hidden * norm_w) (bitwise: one
    fp32 product, one rounding) and against the float64 sums of squares of each 16 columns (a
    16-term fp32 sum of exact squares: within 4 u of it). Its outputs start poisoned, with a
    poisoned guard row past m. -> (stored hidden [m, k], norm_w, device normed, device row_ss)."""
    from gpu_helpers import BF16, DeviceArray, to_bf16
    norm_w, d_nw = _norm_weight(rng, k)
    normed = DeviceArray.poisoned((m + 1, k), BF16)
    row_ss = DeviceArray.poisoned((m + 1, k // 16), np.float32)
    if producer == "embedding":
        table, ids, vocab = _embedding_inputs(rng, m, k)
        hidden, reference = DeviceArray.poisoned((m, k), BF16), DeviceArray.poisoned((m, k), BF16)
        gpu.embedding(hidden, table, ids, m, k, vocab, norm=(d_nw, normed, row_ss))
        gpu.embedding(reference, table, ids, m, k, vocab)
    else:
        inner = 3 * k
        h0 = to_bf16(rng.standard_normal((m, k)) * rng.uniform(0.1, 30))
        x = DeviceArray(_with_nan_rows(to_bf16(rng.standard_normal((m, inner)))))
        _, d_w = _weights(rng, k, inner)
        hidden, reference = DeviceArray(h0), DeviceArray(h0)
        gpu.gemv_residual_norm(hidden, x, d_w, m, k, inner, d_nw, normed, row_ss, k_warps=k_warps)
        gpu.gemv(reference, x, d_w, m, k, inner, accumulate=True, k_warps=k_warps)
    _sync()
    stored = hidden.get()
    np.testing.assert_array_equal(_bits(stored), _bits(reference.get()), err_msg=f"{producer}: hidden changed")
    got_normed, got_ss = normed.get(), row_ss.get()
    np.testing.assert_array_equal(got_normed[:m].astype(np.float32), ref.rms_norm_operand(stored, norm_w),
                                  err_msg="normed != bf16(hidden * norm_w)")
    assert np.all(_bits(got_normed[m]) == 0x7FC0) and np.all(_bits(got_ss[m]) == 0x7FC00000), "wrote past row m"
    exact = (stored.astype(np.float64) ** 2).reshape(m, k // 16, 16).sum(-1)
    assert np.all(np.abs(got_ss[:m] - exact) <= 4 * U * exact + 1e-30), "row sums of squares"
    return stored, norm_w, normed, row_ss


def _rope_twin(twin, bound, positions, freqs, hq: int, hkv: int, d: int):
    """(rotated, rot_bound): the float64 RoPE of the twin's q and k pairs [m, hq + hkv, d] and its
    bound before the bf16 store (module docstring, item 3)."""
    m, half = twin.shape[0], d // 2
    pairs = twin.reshape(m, -1, d)[:, :hq + hkv]
    pair_bound = bound.reshape(m, -1, d)[:, :hq + hkv]
    x1, x2, b1, b2 = pairs[..., :half], pairs[..., half:], pair_bound[..., :half], pair_bound[..., half:]
    angle = positions.astype(np.float64)[:, None, None] * freqs.astype(np.float64)[None, None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    mag = np.abs(x1) + np.abs(x2) + b1 + b2
    return rotated, np.concatenate([b1 + b2 + mag * (U * angle + 2.0 ** -21 + 3 * U)] * 2, axis=-1)


HANDOVER_SHAPES = [(2048, 8192, 32, 8, 64), (576, 1536, 9, 3, 64), (256, 768, 4, 2, 128), (64, 16, 1, 1, 16)]
SLOTS = 64


@pytest.mark.parametrize("producer", ["gemv", "embedding"])
@pytest.mark.parametrize("k_warps", [None, 1, 3, 32])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k,inter,hq,hkv,d", HANDOVER_SHAPES, ids=lambda v: str(v))
def test_handed_over_norm(gpu, rng, k, inter, hq, hkv, d, m, k_warps, producer):
    """The fused decode layer's norm, handed over: gemv_residual_norm's or the embedding's outputs
    (_handed_over: item 1), then the prenormed gate_up + silu and qkv + RoPE GEMVs on them, bitwise
    against gemv_prenormed_bf16 then silu_mul / rope_write_kv (item 2) and against the twin
    rms_norm_linear with the module docstring's bounds (item 3); nothing written past row m, into
    a cache slot no row names, or for the padding row (slot -1; item 4). k_warps 32 on small k
    leaves warps without steps (the ring copies nothing for them), 3 splits K unevenly."""
    import dataclasses

    from gpu_helpers import BF16, DeviceArray

    from tinyvllm.checkpoint.model_writer import preset_config
    from tinyvllm.rope import rope_inv_freq
    stored, norm_w, normed, row_ss = _handed_over(gpu, rng, m, k, k_warps, producer)
    prenormed = (row_ss, EPS)
    # gate_up + silu, and its chain
    w32, d_w = _weights(rng, 2 * inter, k)
    act, gate_up, chain_act = (DeviceArray.poisoned((m + 1, width), BF16) for width in (inter, 2 * inter, inter))
    gpu.gemv_silu_mul(act, normed, d_w, m, 2 * inter, k, prenormed=prenormed, k_warps=k_warps)
    gpu.gemv(gate_up, normed, d_w, m, 2 * inter, k, prenormed=prenormed, k_warps=k_warps)
    gpu.silu_mul(chain_act, gate_up, m, inter)
    # qkv + RoPE + the cache write, and its chain
    n = (hq + 2 * hkv) * d
    q32, d_q = _weights(rng, n, k)
    freqs = rope_inv_freq(dataclasses.replace(preset_config("llama-3.2-1b"), head_dim=d))
    positions = rng.integers(0, 131072, m).astype(np.int32)
    slots = rng.permutation(SLOTS)[:m].astype(np.int32)
    if m > 1:
        slots[1] = -1                                                     # a padding row: no cache write
    rope_in = [DeviceArray(a) for a in (positions, slots, freqs)]
    out = {}
    for path in ("fused", "chain"):
        qkv = DeviceArray.poisoned((m + 1, n), BF16)
        caches = [DeviceArray.poisoned((SLOTS, hkv, d), BF16) for _ in range(2)]
        if path == "fused":
            gpu.gemv_rope_kv(qkv, normed, d_q, m, n, k, *caches, *rope_in, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=d, prenormed=prenormed, k_warps=k_warps)
        else:
            gpu.gemv(qkv, normed, d_q, m, n, k, prenormed=prenormed, k_warps=k_warps)
            gpu.rope_write_kv(qkv, *caches, *rope_in, m, hq, hkv, d)
        _sync()
        out[path] = [qkv.get(), *(c.get() for c in caches)]
    got_act = act.get()
    np.testing.assert_array_equal(_bits(got_act), _bits(chain_act.get()),
                                  err_msg="gemv_prenormed_silu_mul != gemv_prenormed_bf16, silu_mul")
    for name, fused, chain in zip(("qkv", "k cache", "v cache"), out["fused"], out["chain"]):
        np.testing.assert_array_equal(_bits(fused), _bits(chain),
                                      err_msg=f"{name}: gemv_prenormed_rope_kv != gemv_prenormed_bf16, rope_write_kv")
    got_qkv, k_cache, v_cache = out["fused"]
    assert np.all(_bits(got_act[m]) == 0x7FC0) and np.all(_bits(got_qkv[m]) == 0x7FC0), "wrote past row m"
    written = np.zeros(SLOTS, bool)
    written[slots[slots >= 0]] = True
    for cache in (k_cache, v_cache):
        flat = _bits(cache).reshape(SLOTS, -1)
        assert np.all(flat[~written] == 0x7FC0) and not np.any(flat[written] == 0x7FC0), "cache slots"
    # against the twin (item 3)
    twin, bound = _norm_twin(stored, norm_w, w32)
    g, u, dg, du = twin[:, :inter], twin[:, inter:], bound[:, :inter], bound[:, inter:]
    act_got = got_act[:m].astype(np.float64)
    silu_bound = ((np.abs(g) + dg) * du + 1.1 * np.abs(u) * dg + 2.0 ** -19 * (np.abs(g) + dg) * (np.abs(u) + du)
                  + 2.0 ** -8 * np.abs(act_got))
    _within(act_got, g / (1 + np.exp(-g)) * u, silu_bound, "prenormed silu(gate) * up")
    twin, bound = _norm_twin(stored, norm_w, q32)
    q_size, got = hq * d, got_qkv[:m].astype(np.float64)
    _within(got[:, q_size:], twin[:, q_size:], bound[:, q_size:], "prenormed k, v as stored in qkv")
    rotated, rot_bound = _rope_twin(twin, bound, positions, freqs, hq, hkv, d)
    q_got = got[:, :q_size].reshape(m, hq, d)
    _within(q_got, rotated[:, :hq], rot_bound[:, :hq] + 2.0 ** -8 * np.abs(q_got), "prenormed q rotated")
    live = slots >= 0
    k_got = k_cache[slots[live]].astype(np.float64)
    _within(k_got, rotated[live, hq:], rot_bound[live, hq:] + 2.0 ** -8 * np.abs(k_got), "prenormed k cache rotated")
    v_got = v_cache[slots[live]].astype(np.float64)
    v_twin, v_bound = (a[:, q_size + hkv * d:].reshape(m, hkv, d)[live] for a in (twin, bound))
    _within(v_got, v_twin, v_bound, "prenormed v cache")


@pytest.mark.parametrize("k,n,last", [(2048, 128256, True), (576, 49152, True), (256, 1000, False), (64, 40, False)],
                         ids=lambda v: str(v))
def test_prenormed_head(gpu, rng, k, n, last):
    """The LM head after the final norm handed over by the last down (gemv_prenormed_bf16):
    Y = inv_rms * (normed @ W^T) stored fp32 (the logits) or bf16, for m = 1, 4, 8, against the
    twin rms_norm_linear with the module docstring's bound delta (item 3) and, for bf16, the 2^-8 of
    its rounding; the fp32 store adds no rounding. Llama-1B's and SmolLM2's heads at
    gemv_k_warps' `last` rule, small shapes at the plain rule (one weight draw per shape: the
    big heads are 100-525 MB). A guard row past m keeps its poison. Also rejects what it cannot
    do: accumulate, k % 64 != 0, argmax keys beside bf16 output. With fp32 output it also keeps
    each row's greedy argmax key (atomicMax over its CTAs), which must equal the twin
    head_argmax_keys of the very logits it stored, bit for bit; a key past row m keeps its value."""
    from gpu_helpers import BF16, DeviceArray

    from tinyvllm.reference.sampling import head_argmax_keys
    w32, d_w = _weights(rng, n, k)
    for m in (1, 4, 8):
        stored, norm_w, normed, row_ss = _handed_over(gpu, rng, m, k, None)
        twin, bound = _norm_twin(stored, norm_w, w32)
        for out_dtype, dtype in (("float32", np.float32), ("bfloat16", BF16)):
            y = DeviceArray.poisoned((m + 1, n), dtype)
            keys = DeviceArray(np.array([0] * m + [GUARD_KEY], np.uint64))   # the embedding clears them
            fp32 = out_dtype == "float32"
            gpu.gemv(y, normed, d_w, m, n, k, out_dtype=out_dtype, last=last, prenormed=(row_ss, EPS),
                     head_argmax=keys if fp32 else 0)
            _sync()
            got = y.get().astype(np.float32)
            assert np.all(np.isnan(got[m])), "wrote past row m"
            if fp32:   # the greedy argmax keys of exactly the logits it stored
                got_keys = keys.get()
                np.testing.assert_array_equal(got_keys[:m], head_argmax_keys(got[:m]))
                assert got_keys[m] == GUARD_KEY, "a key past row m"
            # fp32: _norm_twin's Delta less the bf16 rounding it adds
            want = bound if out_dtype == "bfloat16" else (bound - 2.0 ** -8 * np.abs(twin)) / (1 + 2.0 ** -8)
            _within(got[:m], twin, want, f"prenormed head m={m} ({out_dtype})")
    with pytest.raises(ValueError, match="accumulate"):
        gpu.gemv(y, normed, d_w, m, n, k, accumulate=True, prenormed=(row_ss, EPS))
    with pytest.raises(ValueError, match="head_argmax"):
        gpu.gemv(y, normed, d_w, m, n, k, out_dtype="bfloat16", prenormed=(row_ss, EPS), head_argmax=keys)
    with pytest.raises(ValueError, match="k % 64 == 0"):
        gpu.gemv(y, normed, d_w, m, n, 72, prenormed=(row_ss, EPS))


def test_fused_launchers_reject(gpu):
    kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=64, prenormed=(0, EPS))
    with pytest.raises(ValueError, match="head_dim"):
        gpu.gemv_rope_kv(0, 0, 0, 1, 250, 64, 0, 0, 0, 0, 0, **kw)                  # n != (2 + 2) * 64
    with pytest.raises(ValueError, match="unsupported shape"):
        gpu.gemv_rope_kv(0, 0, 0, 9, 256, 64, 0, 0, 0, 0, 0, **kw)                  # m = 9
    with pytest.raises(ValueError, match="16-byte aligned"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 32, 64, prenormed=(8, EPS))                   # the row sums
    with pytest.raises(ValueError, match="16-byte aligned"):
        gpu.gemv_residual_norm(0, 0, 0, 1, 32, 64, 0, 8, 0)                         # normed
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 40, 64, prenormed=(0, EPS))
    with pytest.raises(ValueError, match="k % 64 == 0"):
        gpu.gemv_silu_mul(0, 0, 0, 1, 32, 48, prenormed=(0, EPS))                   # whole chunks of row sums
    with pytest.raises(ValueError, match="k % 64 == 0"):
        gpu.gemv_rope_kv(0, 0, 0, 1, 256, 72, 0, 0, 0, 0, 0, **kw)
