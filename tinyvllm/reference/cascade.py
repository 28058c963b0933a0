"""Cascade (shared-prefix) decode attention, the numpy twin: what paged_attention computes for
a decode batch whose sequences all start with the same physical KV blocks
(ForwardBatch.common_prefix_blocks, engine/batch.py), computed the way a cascade kernel does:

  prefix   every sequence's query against the shared prefix's K/V, gathered once: one pass over
           the prefix for all S queries ([Hkv, group * S, D] against [Hkv, D, prefix_len])
  suffix   each sequence's query against its own positions after the prefix (the per-sequence
           decode attention, shorter by the prefix)
  merge    the two partial softmaxes combined exactly through their statistics

A partial over a set J of keys is (o, m, l) per (sequence, query head), with s_j = scale * q . k_j:
    m = max_j s_j,   l = sum_j e^(s_j - m),   o = sum_j e^(s_j - m) v_j   (o unnormalised).
Partials over disjoint key sets merge as
    m = max_i m_i,   l = sum_i e^(m_i - m) l_i,   o = sum_i e^(m_i - m) o_i,   out = o / l,
which in exact arithmetic is the softmax-weighted sum over their union. That is the merge of
cuda/attention_decode.cu's context splits, which keeps m in base 2 (scores scaled by log2 e,
exp2 for exp): the same numbers up to that rescale. A partial over no keys is (0, -inf, 0), which
the merge ignores.

No mask is needed anywhere: a decode query sits at position context_len - 1 and sees every
position below context_len, the whole prefix included (prefix_len <= context_len).
"""
from __future__ import annotations

import numpy as np

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.reference.kernels import as_f32, gather_kv

Partial = tuple[np.ndarray, np.ndarray, np.ndarray]     # o [n, Hq, D], m [n, Hq], l [n, Hq]


def attention_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> Partial:
    """q [n, Hq, D] against every key of k, v [L, Hkv, D] (no mask; query head h reads kv head
    h // (Hq / Hkv)) -> the partial (o, m, l) of each (query, head), float32. L = 0 gives
    (0, -inf, 0). Heads are batched as [Hkv, group * n, D], so the n queries of a kv head read
    its L keys in one matmul."""
    q, k, v = as_f32(q), as_f32(k), as_f32(v)
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    if length == 0:
        return (np.zeros((n, hq, d), np.float32), np.full((n, hq), -np.inf, np.float32),
                np.zeros((n, hq), np.float32))
    qh = q.reshape(n, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = (qh @ k.transpose(1, 2, 0)) * np.float32(scale)            # [Hkv, group*n, L]
    m = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - m)
    l = p.sum(axis=-1)                                                  # [Hkv, group*n]
    o = p @ v.transpose(1, 0, 2)                                        # [Hkv, group*n, D]

    def per_query(x):          # rows ordered (kv head, group, query) -> [n, Hq, ...]
        return np.moveaxis(x.reshape(hkv, group, n, *x.shape[2:]), 2, 0).reshape(n, hq, *x.shape[2:])
    return per_query(o), per_query(m[..., 0]), per_query(l)


def merge_attention_partials(*parts: Partial) -> np.ndarray:
    """The normalised attention output [n, Hq, D] of partials over disjoint key sets (the module
    docstring's merge); at least one of them must hold a key for every (query, head)."""
    m = np.maximum.reduce([p[1] for p in parts])
    if not np.all(np.isfinite(m)):
        raise ValueError("a (query, head) has no key in any partial")
    o = np.zeros_like(parts[0][0])
    l = np.zeros_like(parts[0][2])
    for po, pm, pl in parts:
        alpha = np.exp(pm - m)                  # 0 for an empty partial (m_i = -inf)
        o += alpha[..., None] * po
        l += alpha * pl
    return o / l[..., None]


def prefix_partial(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                   prefix_blocks: int, scale: float) -> Partial:
    """Every query of q [S, Hq, D] against the first prefix_blocks blocks of block_table, their
    K/V gathered once: the cascade's one pass over the shared prefix."""
    prefix_len = prefix_blocks * k_cache.shape[1]
    return attention_partial(q, gather_kv(k_cache, block_table, prefix_len),
                             gather_kv(v_cache, block_table, prefix_len), scale)


def suffix_partials(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: ForwardBatch,
                    prefix_blocks: int, scale: float) -> Partial:
    """Sequence i's query q[i] against its own positions prefix_len .. context_len - 1, each
    through its own block table (an empty range gives the empty partial)."""
    first = prefix_blocks * k_cache.shape[1]
    parts = [attention_partial(q[i:i + 1],
                               gather_kv(k_cache, batch.block_tables[i], int(batch.context_lens[i]), first),
                               gather_kv(v_cache, batch.block_tables[i], int(batch.context_lens[i]), first), scale)
             for i in range(batch.num_seqs)]
    return tuple(np.concatenate([p[j] for p in parts]) for j in range(3))


def cascade_paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: ForwardBatch,
                            scale: float, prefix_blocks: int | None = None) -> np.ndarray:
    """paged_attention of a decode batch (one query per sequence, at position context_len - 1)
    computed as a cascade over its shared prefix of prefix_blocks blocks (default:
    batch.common_prefix_blocks): q [S, Hq, D] -> [S, Hq, D] float32, equal to paged_attention up
    to the order of fp32 operations (tests/test_cascade.py bounds the difference). The prefix's
    blocks must be the same physical blocks in every block table and lie within every context
    (prefix_len = prefix_blocks * block_size <= context_len; equal leaves that sequence no
    positions of its own)."""
    prefix_blocks = batch.common_prefix_blocks if prefix_blocks is None else prefix_blocks
    if batch.num_tokens != batch.num_seqs or not np.array_equal(batch.query_start, np.arange(batch.num_seqs + 1)):
        raise ValueError("cascade attention takes decode batches: one new token per sequence")
    tables = batch.block_tables[:, :prefix_blocks]
    if prefix_blocks * k_cache.shape[1] > int(np.min(batch.context_lens)) or not np.all(tables == tables[:1]):
        raise ValueError(f"the first {prefix_blocks} blocks are not a prefix common to every sequence")
    q = as_f32(q)
    prefix = prefix_partial(q, k_cache, v_cache, batch.block_tables[0], prefix_blocks, scale)
    return merge_attention_partials(prefix, suffix_partials(q, k_cache, v_cache, batch, prefix_blocks, scale))
