"""The numpy twins of what the families beside Llama add (reference/kernels.py), each against an
independent float64 formula, and the reference model's paged forward pass against its dense one
on every family's golden fixture (tests/fixtures/families)."""
import math
from pathlib import Path

import numpy as np
import pytest
from test_reference import fp32_reorder_bound, naive_attention

from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import ModelConfig
from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.reference.kernels import (
    bf16_round,
    causal_gqa_attention,
    gather_kv,
    gelu_tanh_mul,
    linear,
    paged_attention,
    rms_norm,
)
from tinyvllm.reference.model import ReferenceModel

FIXTURES = Path(__file__).parent / "fixtures" / "families"


def test_rms_norm_one_plus_w_adds_the_one_in_fp32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = bf16_round(rng.standard_normal(64) * 0.01)            # small w: 1 + w needs more than bf16
    want = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * (1 + w)
    got = rms_norm(x, w, 1e-6, weight_offset=1.0)
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-7)
    rounded = rms_norm(x, bf16_round(1 + w), 1e-6)             # what storing 1 + w in bf16 would give
    assert np.abs(rounded - want).max() > 100 * np.abs(got - want).max()
    np.testing.assert_array_equal(rms_norm(x, w, 1e-6, 0.0), rms_norm(x, w, 1e-6))


def test_gelu_tanh_mul_is_the_tanh_formula_without_its_cancellation():
    x = np.concatenate([np.linspace(-12, 12, 2401), [-1e4, -100.0, -30.0, 0.0, 30.0, 1e4]]).astype(np.float32)
    up = np.linspace(-2, 3, x.size).astype(np.float32)
    x64 = x.astype(np.float64)
    u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)
    # float64 oracle: the tanh formula where 1 + tanh(u) keeps its digits (u > -6: 1e-5 and up),
    # e^2u / (1 + e^2u), the same number, below (no cancellation there)
    tail = np.exp(2 * np.minimum(u, 0))
    want = x64 * np.where(u > -6, 0.5 * (1 + np.tanh(u)), tail / (1 + tail)) * up
    got = gelu_tanh_mul(x, up)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    # fp32's u errs by a few ulps of itself, which e^-2u turns into ~2|u| ulps of the result:
    # the relative error grows with |u| but never becomes the 100% of the cancelling form; where
    # e^-2u overflows (u < -44) the result is 0 for a value below 1e-37
    tolerance = (8 + 6 * np.abs(u)) * 2.0 ** -24 * np.abs(want) + 1e-37
    assert (np.abs(got - want) <= tolerance).all()
    assert got[x == -1e4][0] == 0 and got[x == 1e4][0] == np.float32(1e4) * up[x == 1e4][0]


def test_linear_adds_the_bias_per_output():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((5, 7)), rng.standard_normal((3, 7)), rng.standard_normal(3)
    np.testing.assert_allclose(linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(linear(x, w), linear(x, w, None))


def test_gather_kv_from_a_position_reads_only_the_blocks_holding_it():
    cache = np.arange(6 * 4, dtype=np.float32).reshape(6, 4, 1, 1)      # value = block * 4 + offset
    table = np.array([10**6, 3, 0, 5])      # block 0 of the sequence is never read
    got = gather_kv(cache, table, context_len=14, first=6)
    np.testing.assert_array_equal(got.reshape(-1), [14, 15, 0, 1, 2, 3, 20, 21])   # positions 6..13


def test_windowed_paged_attention_reads_only_the_window():
    """Per token at position p: softmax over positions p - window + 1 .. p only. Positions before
    the first new token's window hold NaN and the blocks wholly before it are not in the cache
    at all (a block index past its end): reading either would show."""
    rng = np.random.default_rng(2)
    hq, hkv, d, block_size, window, num_blocks = 6, 2, 8, 4, 5, 12
    # seq 0: 9 cached + 4 new (a prefill chunk); seq 1: decode at position 14; seq 2: fresh prompt
    contexts, q_lens = [13, 15, 7], [4, 1, 7]
    tables = [[10**6, 2, 7, 4], [10**6, 10**6, 0, 11], [9, 6]]
    keys = [rng.standard_normal((c, hkv, d)).astype(np.float32) for c in contexts]
    values = [rng.standard_normal((c, hkv, d)).astype(np.float32) for c in contexts]
    k_cache = np.full((num_blocks, block_size, hkv, d), np.nan, np.float32)
    v_cache = k_cache.copy()
    for s, table in enumerate(tables):
        first = max(0, contexts[s] - q_lens[s] - window + 1)
        for p in range(first, contexts[s]):
            k_cache[table[p // block_size], p % block_size] = keys[s][p]
            v_cache[table[p // block_size], p % block_size] = values[s][p]
    batch = ForwardBatch.build([[0] * n for n in q_lens], contexts, [[b % num_blocks for b in t] for t in tables],
                               block_size, is_prefill=True)
    batch.block_tables[:] = np.asarray([t + [-1] * (4 - len(t)) for t in tables])
    q = rng.standard_normal((batch.num_tokens, hq, d)).astype(np.float32)
    got = paged_attention(q, k_cache, v_cache, batch, d ** -0.5, window=window)
    for t in range(batch.num_tokens):
        s = int(np.searchsorted(batch.query_start, t, side="right") - 1)
        pos = int(batch.positions[t])
        lo = max(0, pos - window + 1)
        want = naive_attention(q[t], keys[s][lo:pos + 1], values[s][lo:pos + 1], d ** -0.5)
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5, err_msg=f"token {t}")


def test_dense_windowed_attention_equals_naive():
    rng = np.random.default_rng(3)
    n, hq, hkv, d, window = 11, 4, 2, 8, 3
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    got = causal_gqa_attention(q, k, v, np.arange(n), 0.3, window)
    for p in range(n):
        lo = max(0, p - window + 1)
        np.testing.assert_allclose(got[p], naive_attention(q[p], k[lo:p + 1], v[lo:p + 1], 0.3), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(causal_gqa_attention(q, k, v, np.arange(n), 0.3, n),
                                  causal_gqa_attention(q, k, v, np.arange(n), 0.3))


@pytest.fixture(scope="module", params=["gemma3", "mistral", "qwen2", "qwen3"])
def family_model(request):
    config = ModelConfig.from_pretrained(FIXTURES / request.param)
    return ReferenceModel(config, load_weights(FIXTURES / request.param, config))


def test_paged_prefill_and_decode_equal_the_dense_recompute(family_model):
    """Prompts longer than the windows, prefilled in two chunks, then decoded through the cache
    with scrambled 4-token blocks: every logits row within the fp32 reordering bound of the
    dense pass (tests/test_reference.py's fp32_reorder_bound)."""
    model, rng, block_size = family_model, np.random.default_rng(4), 4
    seq = [int(t) for t in rng.integers(4, model.config.vocab_size, 30)]
    full, bound = model.forward_full(seq), fp32_reorder_bound(model, model.hidden_full(seq))
    table = [int(b) for b in rng.permutation(10)[:8]]
    cache = model.new_kv_cache(10, block_size)
    rows = []
    for start, end in ((0, 13), (13, 22)):
        batch = ForwardBatch.build([seq[start:end]], [end], [table], block_size, True)
        rows.append((model.forward(batch, cache)[0], end - 1))
    for pos in range(22, 30):
        batch = ForwardBatch.build([[seq[pos]]], [pos + 1], [table], block_size, False)
        rows.append((model.forward(batch, cache)[0], pos))
    for got, pos in rows:
        excess = np.abs(got - full[pos]) - bound[pos]
        assert excess.max() <= 0, f"position {pos}: beyond the fp32 bound by {excess.max():.3g}"


def test_gemma_embedding_scale_is_cast_to_the_activation_dtype():
    """Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden) cast to the embedding's dtype:
    fp32 in the fp32 reference, bf16 where activations are rounded to bf16."""
    config = ModelConfig.from_pretrained(FIXTURES / "gemma3")
    weights = load_weights(FIXTURES / "gemma3", config)
    assert ReferenceModel(config, weights).embed_scale == np.float32(math.sqrt(128))
    assert ReferenceModel(config, weights, round_bf16=True).embed_scale == np.float32(11.3125)
