"""The numpy oracle checked against independent, deliberately naive formulas, and against itself:
the paged incremental path must equal a dense full recompute."""
import cmath
import math

import numpy as np
import pytest

from tinyvllm.checkpoint.model_writer import PRESETS
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.reference.kernels import apply_rope, bf16_round, embedding, paged_attention, rms_norm, silu_mul, write_kv
from tinyvllm.reference.model import ReferenceModel
from tinyvllm.rope import rope_inv_freq


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    return ReferenceModel(config, load_weights(tiny_model_dir, config))


def config_with(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**PRESETS["llama-3.2-1b"], **changes})


# ---- kernel twins against direct formulas --------------------------------------------------

def test_llama3_inv_freq_against_per_frequency_formula():
    config = config_with()
    rs = PRESETS["llama-3.2-1b"]["rope_scaling"]
    low_wavelen = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    high_wavelen = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    expected = []
    for i in range(0, 64, 2):
        freq = 1.0 / 500000.0 ** (i / 64)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            expected.append(freq)
        elif wavelen > low_wavelen:
            expected.append(freq / rs["factor"])
        else:
            smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"])
            expected.append((1 - smooth) * freq / rs["factor"] + smooth * freq)
    got = rope_inv_freq(config)
    assert got.dtype == np.float32 and got.shape == (32,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # all three regimes occur with these numbers
    plain = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    assert got[0] == np.float32(plain[0]) and np.isclose(got[-1], plain[-1] / 32)
    assert any(plain[i] / 32 * 1.01 < got[i] < plain[i] * 0.99 for i in range(32))


def test_plain_rope_without_scaling():
    config = config_with(rope_scaling=None, rope_theta=10000.0, head_dim=128)
    np.testing.assert_allclose(rope_inv_freq(config), 10000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-6)


def test_rope_against_complex_rotation():
    rng = np.random.default_rng(0)
    t, heads, d = 5, 3, 16
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 4095])
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    got = apply_rope(x, positions, inv_freq)
    for ti in range(t):
        for h in range(heads):
            for i in range(d // 2):
                z = complex(x[ti, h, i], x[ti, h, i + d // 2]) * cmath.exp(1j * positions[ti] * float(inv_freq[i]))
                assert got[ti, h, i] == pytest.approx(z.real, abs=1e-5)
                assert got[ti, h, i + d // 2] == pytest.approx(z.imag, abs=1e-5)


def test_rms_norm_silu_embedding_against_formulas():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 32)).astype(np.float32) * 5
    w = rng.standard_normal(32).astype(np.float32)
    direct = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), direct, rtol=1e-5, atol=1e-6)
    gate = np.array([-100.0, -3, -0.5, 0, 0.5, 3, 100], np.float32)
    up = np.arange(7, dtype=np.float32) - 2
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(silu_mul(gate, up), gate / (1 + np.exp(-gate.astype(np.float64))) * up,
                                   rtol=1e-6, atol=1e-30)
    table = rng.standard_normal((10, 4)).astype(np.float32)
    np.testing.assert_array_equal(embedding(np.array([3, 3, 9]), table), table[[3, 3, 9]])
    # out-of-range ids give zero rows; fed rows take the previous step's ids (engine/batch.py)
    got = embedding(np.array([3, -1, 9, 2]), table, fed_rows=np.array([-1, -1, 1, 0]), fed_ids=np.array([5, -1]))
    np.testing.assert_array_equal(got, np.stack([table[3], 0 * table[0], 0 * table[0], table[5]]))


def test_bf16_round():
    x = np.array([1.0, 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9, 3.14159, -0.0], np.float32)
    np.testing.assert_array_equal(bf16_round(x), [1.0, 1.0, 1.0 + 2 ** -7, 3.140625, -0.0])


# ---- paged KV cache and attention ---------------------------------------------------------

def test_write_kv_places_tokens_by_slot():
    k_cache, v_cache = np.zeros((2, 5, 4, 2, 3), np.float32)   # 5 blocks of 4 slots
    k = np.arange(3 * 2 * 3, dtype=np.float32).reshape(3, 2, 3)
    write_kv(k_cache, v_cache, k, -k, np.array([5, -1, 2]))     # -1: padding, not written
    np.testing.assert_array_equal(k_cache[1, 1], k[0])
    np.testing.assert_array_equal(v_cache[0, 2], -k[2])
    assert np.count_nonzero(k_cache) == np.count_nonzero(k[0]) + np.count_nonzero(k[2])


def naive_attention(q, keys, values, scale):
    """One query vector per head against explicit per-position key/value lists."""
    hq, hkv = q.shape[0], keys.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = [float(q[h] @ keys[p, kv]) * scale for p in range(len(keys))]
        m = max(scores)
        weights = [math.exp(s - m) for s in scores]
        for p, wgt in enumerate(weights):
            out[h] += wgt / sum(weights) * values[p, kv]
    return out


def test_paged_attention_against_naive_softmax_with_gqa_and_shuffled_blocks():
    rng = np.random.default_rng(2)
    hq, hkv, d, block_size, num_blocks = 6, 2, 8, 4, 12
    # seq 0: 5 cached + 3 new (chunked prefill); seq 1: decode at position 9; seq 2: fresh prompt
    contexts, q_lens = [8, 10, 3], [3, 1, 3]
    tables = [[7, 2], [0, 11, 5], [9]]
    keys = [rng.standard_normal((c, hkv, d)).astype(np.float32) for c in contexts]
    values = [rng.standard_normal((c, hkv, d)).astype(np.float32) for c in contexts]
    k_cache = np.full((num_blocks, block_size, hkv, d), np.nan, np.float32)   # poison unused slots
    v_cache = k_cache.copy()
    for s, table in enumerate(tables):
        for p in range(contexts[s]):
            k_cache[table[p // block_size], p % block_size] = keys[s][p]
            v_cache[table[p // block_size], p % block_size] = values[s][p]
    batch = ForwardBatch.build([[0] * n for n in q_lens], contexts, tables, block_size, is_prefill=True)
    q = rng.standard_normal((batch.num_tokens, hq, d)).astype(np.float32)
    got = paged_attention(q, k_cache, v_cache, batch, scale=d ** -0.5)
    for t in range(batch.num_tokens):
        s = int(np.searchsorted(batch.query_start, t, side="right") - 1)
        pos = int(batch.positions[t])
        want = naive_attention(q[t], keys[s][:pos + 1], values[s][:pos + 1], d ** -0.5)
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5, err_msg=f"token {t}")


# ---- the whole model ----------------------------------------------------------------------

def fp32_reorder_bound(model, hidden: np.ndarray) -> np.ndarray:
    """How far two float32 computations of the same logits may differ when only the order of
    their additions differs (paged vs dense attention, other matmul shapes, another BLAS).

    A float32 dot product of length n is within gamma_n * sum|x_i y_i| of the exact one,
    gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 3.1), so two orders
    differ by at most twice that. The LM head's sums have length H; its input h carries the
    rounding of every layer before it, relatively at most gamma_n per sum on the way (n = the
    longest sum in a layer: H, the intermediate size or the context) for L layers plus the final
    norm, which moves each logit by at most that relative error times (|h| @ |W|^T). First-order
    worst case, independent of the machine's BLAS blocking."""
    c, u = model.config, 2.0 ** -24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    longest = max(c.hidden_size, c.intermediate_size, c.max_position_embeddings)
    relative = 2 * (gamma(c.hidden_size) + (c.num_hidden_layers + 1) * gamma(longest))
    return relative * (np.abs(hidden) @ np.abs(model.lm_head).T)


def test_incremental_paged_decode_equals_full_recompute(tiny):
    rng = np.random.default_rng(3)
    block_size, num_blocks = 4, 40
    prompts = [list(rng.integers(0, 128000, n)) for n in (13, 6)]
    continuation = [list(rng.integers(0, 128000, 5)) for _ in prompts]
    full = [tiny.forward_full(p + c) for p, c in zip(prompts, continuation)]
    bound = [fp32_reorder_bound(tiny, tiny.hidden_full(p + c)) for p, c in zip(prompts, continuation)]

    def check(logits, rows):           # rows: (sequence, position) of each logits row
        for got, (i, t) in zip(logits, rows):
            excess = np.abs(got - full[i][t]) - bound[i][t]
            assert excess.max() <= 0, f"sequence {i} position {t}: beyond the fp32 bound by {excess.max():.3g}"

    tables = [list(b) for b in np.split(rng.permutation(num_blocks)[:12], 2)]
    cache = tiny.new_kv_cache(num_blocks, block_size)
    # prefill both: the first in two chunks (the second chunk reads the cached first one)
    check(tiny.forward(ForwardBatch.build([prompts[0][:8]], [8], tables[:1], block_size, True), cache), [(0, 7)])
    check(tiny.forward(ForwardBatch.build([prompts[0][8:], prompts[1]], [13, 6], tables, block_size, True), cache),
          [(0, 12), (1, 5)])
    for step in range(5):
        ctx = [len(p) + step + 1 for p in prompts]
        batch = ForwardBatch.build([[c[step]] for c in continuation], ctx, tables, block_size, False)
        check(tiny.forward(batch, cache), [(0, ctx[0] - 1), (1, ctx[1] - 1)])


def test_greedy_generate_follows_full_recompute_argmax(tiny):
    prompt = [128000, 9906, 1917, 11]
    tokens = tiny.greedy_generate(prompt, 6)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(np.argmax(tiny.forward_full(seq)[-1])))
    assert tokens == seq[len(prompt):]
    assert tiny.greedy_generate(prompt, 6, stop_token_ids=(tokens[1],)) == tokens[:2]


def test_tiny_model_logits_are_finite_and_varied(tiny):
    logits = tiny.forward_full(np.arange(500, 520))
    assert logits.shape == (20, 128256) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1).all()
    assert len(set(logits.argmax(axis=1))) > 10


def test_bf16_rounded_model_stays_close(tiny_model_dir, tiny):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    rounded = ReferenceModel(config, load_weights(tiny_model_dir, config), round_bf16=True)
    ids = np.arange(700, 716)
    exact, approx = tiny.forward_full(ids), rounded.forward_full(ids)
    error = np.abs(exact - approx)
    assert 0 < error.mean() < 0.02 * exact.std() and error.max() < 0.25 * exact.std()
