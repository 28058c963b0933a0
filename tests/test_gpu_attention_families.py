"""The attention kernels as the model families use them, against reference/kernels.py's
paged_attention on fresh random inputs, outputs poisoned first (test_gpu_kernels.py has the
Llama shapes):

  * sliding windows (attention_prefill_window_d*, attention_decode_window_d*_g*): Mistral's on
    every layer, Gemma 3's and Qwen's on their sliding layers; a token at position p sees
    p - window + 1 .. p. K/V rows the kernel must not read are NaN: for decode every position
    before the window (the kernel starts at the window's first position), for prefill every
    position in a key tile wholly before the window of the sequence's first new token (the tiles
    the kernel skips); a NaN read would reach the output (0 x NaN in the P.V product).
  * head_dim 256 (Gemma 3: prefill on 32-key tiles, decode blocks of 4 warps) and the GQA groups
    5, 6, 7 (Qwen2.5), full context and windowed;
  * a score scale other than head_dim^-1/2 (Gemma 3's query_pre_attn_scalar^-1/2).
Tolerance BF16_TOL (1e-2 relative), derived in test_gpu_kernels.py for these kernels: the
window changes which keys are summed, not the arithmetic.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.reference import kernels as ref

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


def _case(rng, q_lens, context_lens, hq, hkv, d, block_size, scale, window, unread_tile=0):
    """A paged batch with random bf16 q, K, V; K/V rows the kernel must not read are NaN: those
    before each sequence's window (rounded down to unread_tile positions; 1 at decode).
    -> (batch, q, k_cache, v_cache, the twin's output)."""
    from gpu_helpers import shuffled_block_tables, to_bf16
    tables, num_blocks = shuffled_block_tables(rng, context_lens, block_size)
    batch = ForwardBatch.build([[0] * n for n in q_lens], list(context_lens), tables, block_size,
                               is_prefill=True)
    k_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    if window and unread_tile:
        for i, (n, ctx) in enumerate(zip(q_lens, context_lens)):
            unread = max(0, ctx - n - window + 1) // unread_tile * unread_tile
            for pos in range(unread):
                block, offset = tables[i][pos // block_size], pos % block_size
                k_cache[block, offset] = v_cache[block, offset] = np.nan
    k_cache, v_cache = to_bf16(k_cache), to_bf16(v_cache)
    q = to_bf16(rng.standard_normal((batch.num_tokens, hq, d)))
    want = ref.paged_attention(q, k_cache, v_cache, batch, scale, window or None)
    assert np.all(np.isfinite(want)), "the twin read an unread row"
    return batch, q, k_cache, v_cache, want


def _device(batch, *arrays):
    from gpu_helpers import DeviceArray
    width = np.array([batch.block_tables.shape[1]], np.int32)
    return [DeviceArray(a) for a in (*arrays, batch.block_tables, width, batch.query_start, batch.context_lens)]


# (query heads, kv heads, head_dim, block size, window): Gemma-3-1B (4/1 x 256, window 512), its
# fixture (2/1 x 256, window 8), Mistral (32/8 x 128, 4096), Qwen2.5-0.5B (14/2 x 64: group 7),
# groups 5 and 6; windows of 1 (a token sees itself), smaller than a block, across tiles
SHAPES = [(4, 1, 256, 16, 512), (2, 1, 256, 4, 8), (8, 2, 128, 16, 100), (14, 2, 64, 16, 1),
          (10, 2, 64, 8, 37), (12, 2, 128, 32, 64), (8, 4, 256, 16, 0), (14, 2, 64, 16, 0)]


@pytest.mark.parametrize("hq,hkv,d,block_size,window", SHAPES)
def test_attention_prefill_families(gpu, rng, hq, hkv, d, block_size, window):
    """Ragged prompts (around the 64-row query tile and the 32/64-key tiles) with and without a
    cached prefix, scale 0.7 / sqrt(d)."""
    from gpu_helpers import DeviceArray, rel_err
    q_lens = [1, 15, 64, 65, 129, 2, 300, 40]
    ctx = [a + b for a, b in zip(q_lens, [0, 3, 0, 64, 100, 700, 37, 1000])]
    scale = 0.7 / np.sqrt(d)
    batch, q, kc, vc, want = _case(rng, q_lens, ctx, hq, hkv, d, block_size, scale, window, unread_tile=64)
    out = DeviceArray.poisoned((batch.num_tokens, hq, d), q.dtype)
    d_q, d_k, d_v, *rest = _device(batch, q, kc, vc)
    gpu.attention_prefill(out, d_q, hq * d, d_k, d_v, *rest, num_seqs=batch.num_seqs, max_query_len=max(q_lens),
                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size, scale=scale,
                          window=window)
    _sync()
    got = out.get()
    for i in range(batch.num_seqs):
        s, e = batch.query_start[i], batch.query_start[i + 1]
        assert rel_err(got[s:e], want[s:e]) < BF16_TOL, f"sequence {i} (q_len {q_lens[i]}, context {ctx[i]})"


# contexts around the window, the 16-token step, the minimum split (64 tokens at head_dim 256, 128
# else) and the one-split limit (512), and long ones that split
DECODE_CONTEXTS = [1, 2, 15, 16, 17, 64, 65, 129, 300, 511, 512, 513, 600, 1024, 3000, 5000]


@pytest.mark.parametrize("hq,hkv,d,block_size,window", SHAPES)
@pytest.mark.parametrize("splits", [None, 1, 5, 32])
def test_attention_decode_families(gpu, rng, hq, hkv, d, block_size, window, splits):
    """Every context of DECODE_CONTEXTS at batch 1 and all of them in one batch; every K/V row
    before the window NaN; scale 0.7 / sqrt(d). As test_gpu_kernels' decode test: counters back
    at zero, and a second launch on the same buffers gives the same bits."""
    from gpu_helpers import DeviceArray, rel_err

    from tinyvllm.gpu.ops import MAX_DECODE_SPLITS
    scale = 0.7 / np.sqrt(d)
    for ctx in [[c] for c in DECODE_CONTEXTS] + [[int(c) for c in rng.permutation(DECODE_CONTEXTS)]]:
        batch, q, kc, vc, want = _case(rng, [1] * len(ctx), ctx, hq, hkv, d, block_size, scale, window, unread_tile=1)
        S = batch.num_seqs
        part_out = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, d), np.float32)
        part_ml = DeviceArray.poisoned((S, hq, MAX_DECODE_SPLITS, 2), np.float32)
        counters = DeviceArray(np.zeros((S, hkv), np.int32))
        d_q, d_k, d_v, d_tables, d_width, _, d_ctx = _device(batch, q, kc, vc)
        first = None
        for launch in range(2):
            out = DeviceArray.poisoned((S, hq, d), q.dtype)
            gpu.attention_decode(out, part_out, part_ml, counters, d_q, hq * d, d_k, d_v, d_tables, d_width, d_ctx,
                                 num_seqs=S, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size,
                                 scale=scale, splits=splits, window=window)
            _sync()
            got = out.get()
            for i in range(S):
                assert rel_err(got[i], want[i]) < BF16_TOL, f"launch {launch}, sequence {i} (context {ctx[i]})"
            np.testing.assert_array_equal(counters.get(), 0)
            if first is None:
                first = got.view(np.uint16)
            else:
                np.testing.assert_array_equal(got.view(np.uint16), first)


def test_attention_rejects_a_negative_window(gpu):
    with pytest.raises(ValueError, match="window"):
        gpu.attention_decode(0, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, num_seqs=1, num_q_heads=1, num_kv_heads=1,
                             head_dim=64, block_size=16, scale=1.0, window=-1)
