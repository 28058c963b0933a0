"""The kernels a tensor-parallel rank adds (cuda/tensor_parallel.cu, launched by
gpu/ops/tensor_parallel.py) against their numpy twins, on one GPU (marker gpu), on fresh random
inputs with the outputs poisoned first: the embedding gather of one vocabulary slice (a copy, and
Gemma 3's scaled copy: exact), the residual add after an all-reduce with and without the next
norm handed over (one rounding: exact), the LM head's argmax keys shifted to full-vocabulary
ids (exact), and every rank's logits placed into their columns of the full ones (a copy: exact)."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.parallel.sharding import balanced
from tinyvllm.parallel.vocab_parallel import gather_vocab, shard_argmax_keys
from tinyvllm.reference import kernels as ref
from tinyvllm.reference.sampling import head_argmax_keys

pytestmark = pytest.mark.gpu
KEY_GUARD = 0x0123456789ABCDEF


def _sync():
    import pycuda.driver as drv
    drv.Context.synchronize()


@pytest.mark.parametrize("vocab,hidden,tokens,size", [(1000, 256, 37, 2), (128256, 2048, 5, 4), (49152, 576, 3, 3)])
@pytest.mark.parametrize("fed", [False, True])
@pytest.mark.parametrize("scale", [None, 45.25], ids=["plain", "scaled"])
def test_embedding_gather_shard(gpu, rng, vocab, hidden, tokens, size, fed, scale):
    """Every rank's gather of its slice of the table: its ids' rows (times scale, rounded to
    bf16), zero rows for every other id (another rank's, -1, vocab), so the sum over the ranks is
    the whole lookup (ref.embedding, times scale), with exactly one non-zero row per in-range id.
    Fed ids as embedding_gather's; the LM head's argmax keys cleared for the step's tokens."""
    from gpu_helpers import BF16, DeviceArray, to_bf16
    table = to_bf16(rng.standard_normal((vocab, hidden)))
    ids = rng.integers(0, vocab, tokens).astype(np.int32)
    ids[rng.integers(0, tokens)] = rng.choice([-1, vocab])
    fed_rows = fed_ids = None
    resolved = ids.astype(np.int64)
    if fed:
        fed_ids = rng.integers(0, vocab, 8).astype(np.int32)
        fed_ids[rng.integers(0, 8)] = -1
        fed_rows = np.where(rng.random(tokens) < 0.5, rng.integers(0, 8, tokens), -1).astype(np.int32)
        resolved[fed_rows >= 0] = fed_ids[fed_rows[fed_rows >= 0]]
    whole = ref.embedding(ids, table, fed_rows, fed_ids)
    if scale is not None:
        whole = ref.bf16_round(whole * np.float32(scale))
    total = np.zeros((tokens, hidden), np.float32)
    for rank in range(size):
        rows = balanced(vocab, size, rank)
        shard = np.ascontiguousarray(table[rows.start:rows.stop])
        keep = [DeviceArray(a) for a in (shard, ids, fed_rows, fed_ids) if a is not None]   # alive until the sync
        keys = DeviceArray(np.full(tokens + 1, KEY_GUARD, np.uint64))
        out = DeviceArray.poisoned((tokens, hidden), BF16)
        gpu.embedding_shard(out, keep[0], keep[1], tokens, hidden, rows.start, len(rows),
                            fed_rows=keep[2] if fed else 0, fed_ids=keep[3] if fed else 0, head_argmax=keys,
                            scale=scale)
        _sync()
        got = out.get().astype(np.float32)
        want = ref.embedding(resolved - rows.start, shard)
        if scale is not None:
            want = ref.bf16_round(want * np.float32(scale))
        np.testing.assert_array_equal(got, want)
        held = (resolved >= rows.start) & (resolved < rows.stop)
        assert not got[~held].any(), "ids of other slices give zero rows"
        got_keys = keys.get()
        assert not got_keys[:tokens].any() and got_keys[tokens] == KEY_GUARD
        total += got
    np.testing.assert_array_equal(total, whole)


@pytest.mark.parametrize("hidden", [256, 2048, 4096])
@pytest.mark.parametrize("add", [True, False], ids=["add", "hand_over_only"])
@pytest.mark.parametrize("hand_over", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_residual_add(gpu, rng, hidden, add, hand_over, offset):
    """hidden = bf16(hidden + x) (x: the all-reduced product; none: hidden unchanged), then the
    next norm handed over: normed == ref.rms_norm_operand(new hidden, w, offset) bitwise, each
    row sum of 16 squares within 4 u of its float64 value; a guard row past the rows keeps its
    poison. Without a hand-over, normed and row_ss are not touched."""
    from gpu_helpers import BF16, DeviceArray, to_bf16
    if not add and not hand_over:
        pytest.skip("nothing to do: never launched so")
    T = 7
    h0 = to_bf16(rng.standard_normal((T + 1, hidden)) * 2)
    x = to_bf16(rng.standard_normal((T + 1, hidden)))
    w = to_bf16(1 + 0.1 * rng.standard_normal(hidden))
    hidden_dev, x_dev, w_dev = DeviceArray(h0), DeviceArray(x), DeviceArray(w)
    normed = DeviceArray.poisoned((T + 1, hidden), BF16)
    row_ss = DeviceArray.poisoned((T + 1, hidden // 16), np.float32)
    gpu.residual_add(hidden_dev, x_dev if add else 0, T, hidden, offset,
                     hand_over=(w_dev, normed, row_ss) if hand_over else None)
    _sync()
    got = hidden_dev.get().astype(np.float32)
    want = ref.bf16_round(h0[:T].astype(np.float32) + x[:T].astype(np.float32)) if add else h0[:T].astype(np.float32)
    np.testing.assert_array_equal(got[:T], want)
    np.testing.assert_array_equal(got[T], h0[T].astype(np.float32))        # the guard row: untouched
    got_normed, got_ss = normed.get().astype(np.float32), row_ss.get()
    if not hand_over:
        assert np.all(np.isnan(got_normed)) and np.all(np.isnan(got_ss))
        return
    np.testing.assert_array_equal(got_normed[:T], ref.rms_norm_operand(want, w, offset))
    exact = (want.astype(np.float64) ** 2).reshape(T, hidden // 16, 16).sum(-1)
    assert np.all(np.abs(got_ss[:T] - exact) <= 4 * 2.0 ** -24 * exact), "row sums of squares"
    assert np.all(np.isnan(got_normed[T])) and np.all(np.isnan(got_ss[T]))


def test_residual_add_rejects_a_hidden_size_it_cannot_chunk(gpu):
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu.residual_add(0, 0, 1, 264)


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_shift_argmax_keys(gpu, rng, rows):
    """A rank's keys (reference/sampling.py's head_argmax_keys of its logits, with a NaN row and
    an all -inf row) shifted by its first id equal vocab_parallel.shard_argmax_keys; a guard entry
    past the rows keeps its value."""
    from gpu_helpers import DeviceArray
    shard, start = 1000, 64128
    logits = rng.standard_normal((rows, shard)).astype(np.float32)
    logits[0, rng.integers(0, shard)] = np.nan
    if rows > 1:
        logits[1] = -np.inf
    keys = DeviceArray(np.append(head_argmax_keys(logits), np.uint64(KEY_GUARD)))
    gpu.shift_argmax_keys(keys, rows, start)
    _sync()
    got = keys.get()
    np.testing.assert_array_equal(got[:rows], shard_argmax_keys(logits, start))
    assert got[rows] == KEY_GUARD


@pytest.mark.parametrize("vocab,size,rows", [(128256, 2, 1), (1001, 4, 5), (49152, 3, 16)])
def test_place_vocab_slice(gpu, rng, vocab, size, rows):
    """Every rank's slice [rows, its size] (as the broadcast leaves it, in parts of max_seqs rows)
    placed into [rows, vocab]: vocab_parallel.gather_vocab of the slices, bit for bit, with NaN
    and inf values copied as they are; a guard row past the rows keeps its poison."""
    from gpu_helpers import DeviceArray
    slices = [balanced(vocab, size, r) for r in range(size)]
    parts = [rng.standard_normal((rows, len(v))).astype(np.float32) for v in slices]
    parts[0][0, 0], parts[-1][-1, -1] = np.nan, np.inf
    keep = [DeviceArray(p) for p in parts]
    logits = DeviceArray.poisoned((rows + 1, vocab), np.float32)
    for part, v in zip(keep, slices):
        gpu.place_vocab_slice(logits, part, rows, len(v), v.start, vocab)
    _sync()
    got = logits.get()
    np.testing.assert_array_equal(got[:rows].view(np.uint32), gather_vocab(parts).view(np.uint32))
    assert np.all(np.isnan(got[rows]))
    with pytest.raises(ValueError, match="is not inside a vocabulary of"):
        gpu.place_vocab_slice(logits, keep[0], rows, len(slices[-1]), slices[-1].start + 1, vocab)
