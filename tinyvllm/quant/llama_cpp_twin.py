"""A numpy twin of how llama.cpp's CPU backend multiplies activations by GGUF blocks, and the
near-tie bound derived from it: what a comparison of tinyvllm's quantized reference model with
llama.cpp itself (tests/fixtures/smollm2_llamacpp_golden.json, benchmarks/llama_cpp_golden.py)
may forgive.

llama.cpp does not dequantize the weights for a matrix product: it quantizes each row of the
activations x in blocks of 32 to the weight type's partner (ggml's vec_dot_type) and sums
integer products block by block (AVX2 path; the scalar reference rounds the same way):
    Q8_0 (beside Q8_0 and Q4_0 weights), and Q8_1 (beside Q4_1), per block b of x:
        a_b  = max_i |x_i|,   D_b = fl32(a_b / 127),   q_i = rint(x_i * fl32(127 / a_b))  (int8)
        D'_b = fp16(D_b);     Q8_1 also stores s_b = fp16(D_b * sum_i q_i)
    Q8_0 x Q8_0:  d_w D'_b sum_i qw_i q_i
    Q4_0 x Q8_0:  d_w D'_b sum_i (c_i - 8) q_i
    Q4_1 x Q8_1:  d_w D'_b sum_i c_i q_i + m_w s_b
with d_w, m_w the block's fp16 scale and min and the integer sums exact. llama_cpp_linear is that
formula in float32 (its accumulation order differs: relative 2^-24 a term, negligible here).
K-quant weights pair with Q8_K (256-element blocks, float32 scales) and have no twin here.

The near-tie bound (teacher_forced). Three runs of the reference model over the same tokens:
    ours   the quantized twins (block_format.linear: bf16 activations, bf16-rounded weights)
    exact  the file's weights exactly (float32 dequantization) and float32 activations
    llama  the file's weights with activations rounded as above (llama_cpp_linear)
e_ours = ours - exact is measured; e_llama = llama - exact stands for llama.cpp's own error.
If llama.cpp's logits are exact + e_llama, then where its argmax l differs from ours a,
    ours_a - ours_l  <=  |e_ours_a - e_ours_l| + |e_llama_a - e_llama_l|  <=  2 delta_t,
    delta_t = max_v |e_ours_v| + max_v |e_llama_v|         (the step's largest logit moves)
so a divergence at a step whose gap ours_a - ours_l is at most 2 delta_t is a near-tie, and any
other is a bug. What the twin leaves out: llama.cpp's attention converts q, K, V and the softmax
probabilities to fp16 (relative 2^-11 each, against the 8-bit rounding of every linear input
above, 2^-8 of a block's largest value) and sums in its own order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.quant.block_format import QuantizedWeight

BLOCK = 32


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [m, k] float32 -> (q [m, k/32, 32] integer-valued float32, D' [m, k/32] (fp16 values),
    s [m, k/32] (fp16 values)): llama.cpp's Q8_1 blocks of every row (Q8_0 is the same without s)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[:, :, None])
    d16 = d.astype(np.float16).astype(np.float32)
    s16 = (d * q.sum(axis=2)).astype(np.float16).astype(np.float32)
    return q, d16, s16


def integer_form(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q8_0 / Q4_0 / Q4_1 matrix as (integer codes [n, k/32, 32] (Q4_0's minus 8), d [n, k/32],
    m [n, k/32] or None), in the float32 values llama.cpp's dot products read."""
    n, k = weight.shape
    name = weight.format.name
    if name not in ("Q8_0", "Q4_0", "Q4_1"):
        raise ValueError(f"no twin of llama.cpp's {name} dot product (K-quants pair with Q8_K)")
    q, d, m = weight.fields()                                         # d, m: [blocks, 1]
    return (q.astype(np.float32).reshape(n, k // BLOCK, BLOCK), d.reshape(n, k // BLOCK),
            m.reshape(n, k // BLOCK) if name == "Q4_1" else None)


def llama_cpp_linear(x: np.ndarray, weight, bias=None) -> np.ndarray:
    """Y[m, n] as llama.cpp's CPU backend computes X @ W^T for GGUF blocks W (module docstring);
    a float W (the norms' kind; no matrix of the default model) is a float32 product. Each
    block's d_w D'_b sum_i c_i q_i is summed as sum_i (d_w c_i)(D'_b q_i): both factors exact in
    float32, the sum in float32 (llama.cpp sums the integers exactly, then scales: the two
    orders differ by float32 rounding, relative 2^-24 a term)."""
    if not isinstance(weight, QuantizedWeight):
        y = np.asarray(x, np.float32) @ np.asarray(weight, np.float32).T
    else:
        q, dx, sx = quantize_activations(x)
        codes, dw, mw = integer_form(weight)
        xq = (q * dx[:, :, None]).reshape(q.shape[0], -1)
        y = xq @ (codes * dw[:, :, None]).reshape(codes.shape[0], -1).T
        if mw is not None:
            y += sx @ mw.T
    return y if bias is None else y + np.asarray(bias, np.float32)


def exact_linear(x: np.ndarray, weight, bias=None) -> np.ndarray:
    """float32 X @ W^T with W the file's exact values (float32 dequantization, no bf16)."""
    w = weight.dequantize() if isinstance(weight, QuantizedWeight) else np.asarray(weight, np.float32)
    y = np.asarray(x, np.float32) @ w.T
    return y if bias is None else y + np.asarray(bias, np.float32)


@dataclass(frozen=True)
class TeacherForced:
    """Per step t of a token sequence fed whole: our logits and the step's delta_t."""
    logits: np.ndarray        # [steps, V] float32: the quantized twins' (ours)
    delta: np.ndarray         # [steps]: max_v |ours - exact| + max_v |llama - exact|
    llama_ids: np.ndarray     # [steps]: the argmax of the llama twin's logits

    def forgiven(self, step: int, llama_id: int) -> tuple[float, bool]:
        """(our gap between our argmax and llama.cpp's id, whether it is at most 2 delta_t)."""
        row = self.logits[step]
        gap = float(row.max() - row[llama_id])
        return gap, gap <= 2 * float(self.delta[step])


def teacher_forced(model, prompt_ids: list[int], generated_ids: list[int]) -> TeacherForced:
    """Feed prompt + generated[:-1] once (every step's prefix is llama.cpp's own) through the
    reference model `model` (its weights GGUF blocks) three ways; step t is the position that
    predicts generated[t]."""
    ids = np.asarray(list(prompt_ids) + list(generated_ids[:-1]), np.int32)
    steps = slice(len(prompt_ids) - 1, len(ids))
    saved = model.linear
    runs = {}
    try:
        for name, fn in (("ours", saved), ("exact", exact_linear), ("llama", llama_cpp_linear)):
            model.linear = fn
            runs[name] = model.forward_full(ids)[steps]
    finally:
        model.linear = saved
    delta = (np.abs(runs["ours"] - runs["exact"]).max(axis=1)
             + np.abs(runs["llama"] - runs["exact"]).max(axis=1))
    return TeacherForced(runs["ours"], delta, runs["llama"].argmax(axis=1))
