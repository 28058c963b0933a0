"""The numpy float32 oracle: one function per GPU kernel, from which reference/model.py builds
the forward pass of every model family. GPU tests compare every kernel against these; the
engine's CPU backend runs on them.

Everything computes in float32 whatever the input dtype (bf16 inputs are widened first). Pass
`round_bf16=True` to ReferenceModel to round activations to bf16 wherever the GPU stores them,
which narrows the gap between this oracle and bf16 kernels.

Shapes: T new tokens, S sequences, H hidden, Hq/Hkv query/kv heads, D head_dim, V vocab.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.quant.weight_kinds import embedding_rows
from tinyvllm.quant.weight_kinds import linear as quantized_linear


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (round to nearest even) -> float32: what storing in bf16 does to a value."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def as_f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# ---- one twin per kernel ------------------------------------------------------------------

def embedding(token_ids: np.ndarray, table: np.ndarray, fed_rows=None, fed_ids=None) -> np.ndarray:
    """[T] ids, [V, H] table (of any weight kind: a quantized one dequantizes only the rows
    read) -> [T, H] float32; an id outside [0, V) gives a zero row. fed_rows
    [T] (None: none): where >= 0, token t's id is fed_ids[fed_rows[t]] (the previous step's
    sampled ids: engine/batch.py's "Fed tokens") instead of token_ids[t]."""
    ids = np.asarray(token_ids, np.int64).copy()
    if fed_rows is not None:
        fed = np.asarray(fed_rows) >= 0
        ids[fed] = np.asarray(fed_ids, np.int64)[np.asarray(fed_rows)[fed]]
    valid = (ids >= 0) & (ids < table.shape[0])
    return np.where(valid[:, None], embedding_rows(table, np.where(valid, ids, 0)), np.float32(0))


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """Y[m, n] = X[m, k] @ W[n, k]^T (+ bias[n]), W as HF stores it [out, in] (gpu/ops/gemv.py's
    linear()). The bias is nn.Linear's: added to the fp32 product (Qwen2's q/k/v). A quantized W
    (FP8, GGUF blocks) runs its own twin (tinyvllm/quant/weight_kinds.py::linear)."""
    y = quantized_linear(x, w)
    return y if bias is None else y + as_f32(bias)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, weight_offset: float = 0.0) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * (weight_offset + weight) over the last axis, in float32.
    weight_offset 1 is Gemma3RMSNorm's x * (1 + w), the sum taken in fp32 as there (1 + w
    rounded to bf16 would lose w's low bits)."""
    x = as_f32(x)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    scale = as_f32(weight) + np.float32(weight_offset) if weight_offset else as_f32(weight)
    return x / np.sqrt(mean_square + np.float32(eps)) * scale


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate [T, heads, D] by angle position * inv_freq. HF's "rotate_half" pairing: dimension i
    and i + D/2 form one 2-D pair (not the interleaved 2i, 2i+1 of the original paper)."""
    x = as_f32(x)
    half = x.shape[-1] // 2
    # angles in float64: the oracle should not inherit fp32's error at large positions
    angle = np.asarray(positions, np.float64)[:, None] * as_f32(inv_freq).astype(np.float64)[None, :]
    cos = np.cos(angle).astype(np.float32)[:, None, :]   # [T, 1, D/2], broadcast over heads
    sin = np.sin(angle).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu_tanh(gate) * up in fp32: Gemma 3's GeGLU (ACT2FN["gelu_pytorch_tanh"], torch's
    gelu(approximate="tanh")). gelu_tanh(x) = x * (1 + tanh(u)) / 2 with u = sqrt(2/pi) * (x +
    0.044715 x^3); written as x / (1 + e^(-2u)), the same function without the cancellation of
    1 + tanh(u) for very negative u (see silu_mul). For u < -44, e^(-2u) overflows to inf and
    x / inf = -0, the right limit; the cube overflows only past |x| ~ 1.4e13."""
    x = as_f32(gate)
    u = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(np.float32(-2) * u)) * as_f32(up)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up = gate / (1 + e^-gate) * up in fp32, the kernels' formula (common.cuh
    silu_times). No cancellation anywhere: the relative error stays a few fp32 ulps for every
    gate (the tanh form 0.5 * (1 + tanh(gate / 2)) loses all of it below gate ~ -12, where 1 + tanh
    cancels). For gate < -88, e^-gate overflows to inf and gate / inf = -0, the right limit."""
    gate = as_f32(gate)
    with np.errstate(over="ignore"):
        return gate / (np.float32(1) + np.exp(-gate)) * as_f32(up)


# ---- the fused decode GEMVs' formulas for their operands (cuda/gemv.cu) ------------------
# The fused decode layer's GEMVs take the RMSNorm's scale out of the dot product (gemv.cu's
# header: the handed-over norm): their operand is bf16(x * weight), the product is scaled by
# inv_rms in fp32 after the sum. That is RMSNorm-then-linear up to rounding
# (tests/test_reference_fused.py bounds it), not its bits. The silu epilogue's operand is what
# silu_mul stores.

def rms_norm_operand(x: np.ndarray, weight: np.ndarray, weight_offset: float = 0.0) -> np.ndarray:
    """bf16(x * weight): the prenormed GEMVs' X operand, written by the kernel before the norm
    (the fp32 product of two bf16 values is exact, so this is the kernel's one rounding). With a
    weight offset (Gemma 3's 1 + w, the sum in fp32) the fp32 product is rounded first."""
    scale = as_f32(weight) + np.float32(weight_offset) if weight_offset else as_f32(weight)
    return bf16_round(as_f32(x) * scale)


def rms_inv(x: np.ndarray, eps: float) -> np.ndarray:
    """1 / sqrt(mean(x^2) + eps) per row of x [m, k], fp32 -> [m, 1]."""
    x = as_f32(x)
    return np.float32(1) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))


def rms_norm_linear(x: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, eps: float,
                    weight_offset: float = 0.0) -> np.ndarray:
    """Y = inv_rms * (bf16(x * norm_weight) @ W^T), x the residual stream [m, k]: RMSNorm then
    linear as the fused decode layer's GEMVs compute it (fp32 product, then times inv_rms per row)."""
    return linear(rms_norm_operand(x, norm_weight, weight_offset), w) * rms_inv(x, eps)


def silu_mul_operand(gate_up: np.ndarray) -> np.ndarray:
    """bf16(silu(gate) * up) over [..., 2 * inter] rows (gate first): what silu_mul and the
    gate_up GEMV's silu epilogue store."""
    inter = gate_up.shape[-1] // 2
    return bf16_round(silu_mul(gate_up[..., :inter], gate_up[..., inter:]))


def silu_mul_linear(gate_up: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Y = bf16(silu(gate) * up) @ W^T over the fused gate_up rows (silu_mul, then linear)."""
    return linear(silu_mul_operand(gate_up), w)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Store new K/V [T, Hkv, D] into the paged caches [blocks, block_size, Hkv, D] in place.
    slot = block * block_size + offset; a negative slot marks a padding token and is skipped."""
    slots = np.asarray(slot_mapping, np.int64)
    keep = slots >= 0
    block_size = k_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    k_cache[blocks, offsets] = np.asarray(k)[keep]
    v_cache[blocks, offsets] = np.asarray(v)[keep]


def gather_kv(cache: np.ndarray, block_table: np.ndarray, context_len: int, first: int = 0) -> np.ndarray:
    """One sequence's positions first..context_len-1 out of a paged cache -> [context_len -
    first, Hkv, D]; only the blocks holding them are read."""
    block_size = cache.shape[1]
    skipped = first // block_size
    blocks = np.asarray(block_table[skipped: math.ceil(context_len / block_size)], np.int64)
    base = skipped * block_size              # the position of the first row read
    return cache[blocks].reshape(-1, *cache.shape[2:])[first - base: context_len - base]


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    batch: ForwardBatch, scale: float, window: int | None = None) -> np.ndarray:
    """Causal attention of each new token over its own sequence's positions 0..position, reading
    K/V through the block tables. q [T, Hq, D] -> [T, Hq, D] float32. Query head h reads kv head
    h // (Hq / Hkv) (grouped-query attention). With a window (a sliding layer), a token at
    position p sees positions p - window + 1 .. p, and only the blocks holding the window of the
    sequence's first new token onwards are read."""
    q = as_f32(q)
    out = np.empty_like(q)
    for i in range(batch.num_seqs):
        start, end = int(batch.query_start[i]), int(batch.query_start[i + 1])
        if end == start:
            continue
        ctx = int(batch.context_lens[i])
        first = 0 if window is None else max(0, int(batch.positions[start]) - window + 1)
        k = as_f32(gather_kv(k_cache, batch.block_tables[i], ctx, first))
        v = as_f32(gather_kv(v_cache, batch.block_tables[i], ctx, first))
        out[start:end] = causal_gqa_attention(q[start:end], k, v, batch.positions[start:end], scale,
                                              window, first)
    return out


def causal_gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                          scale: float, window: int | None = None, first: int = 0) -> np.ndarray:
    """q [n, Hq, D] at `positions`; k, v [ctx - first, Hkv, D] for positions first..ctx-1 ->
    [n, Hq, D]. A query at position p sees keys at p' <= p, and with a window only those with
    p' > p - window (transformers' sliding_window_overlay: the window counts p itself). Heads are
    batched as [Hkv, group * n, D] so that the work is a few BLAS matmuls."""
    n, hq, d = q.shape
    ctx, hkv, _ = k.shape
    group = hq // hkv
    qh = q.reshape(n, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = (qh @ k.transpose(1, 2, 0)) * np.float32(scale)            # [Hkv, group*n, ctx]
    row_pos = np.tile(np.asarray(positions, np.int64), group)[:, None]  # rows ordered (g, n)
    key_pos = np.arange(first, first + ctx)[None, :]
    hidden = key_pos > row_pos
    if window is not None:
        hidden |= key_pos <= row_pos - window
    scores[:, hidden] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v.transpose(1, 0, 2)                                  # [Hkv, group*n, D]
    return out.reshape(hkv, group, n, d).transpose(2, 0, 1, 3).reshape(n, hq, d)
