"""The launchers of the row-wise kernels: the embedding gather, RMSNorm (and Gemma 3's norm added
into the residual), RoPE with the KV-cache write, and SwiGLU / GeGLU (embedding.cu, rmsnorm.cu,
rope_kv.cu, activation.cu)."""
from __future__ import annotations

from tinyvllm.gpu.kernels import kernel_constants
from tinyvllm.gpu.ops.launch import OpsBase

EMBEDDING = kernel_constants("embedding.cu")
RMS_NORM = kernel_constants("rmsnorm.cu")
ROPE = kernel_constants("rope_kv.cu")
SILU = kernel_constants("activation.cu")


class RowwiseOps(OpsBase):
    def embedding(self, out, table, token_ids, num_tokens: int, hidden: int, vocab_size: int,
                  fed_rows=0, fed_ids=0, norm=None, head_argmax=0, scale: float | None = None,
                  norm_offset: float = 0.0) -> None:
        """out[t] = table[id_t] (bf16 rows; an id outside the vocab gives a zero row), id_t =
        fed_ids[fed_rows[t]] where fed_rows (int32 [num_tokens], 0: none) is >= 0, else
        token_ids[t]. norm = (norm_weight, normed, row_ss): the first layer's input norm handed
        over as gemv_residual_norm() hands the others over (embedding.cu's header): normed [T,
        hidden] = bf16(out * norm_weight), row_ss (fp32 [T, hidden / 16]) the rows' sums of
        squares of 16 columns each, for gemv_rope_kv(prenormed=(row_ss, eps)). head_argmax (uint64
        [num_tokens], 0: none): cleared to 0 for the LM head's argmax keys (gemv(head_argmax=)).
        scale (Gemma 3: bf16(sqrt(hidden)); None: none): every value times scale, rounded to bf16;
        norm_offset: the handed-over norm's weight is (norm_offset + w) (Gemma 3: 1)
        (embedding_gather_scaled)."""
        norm_w, normed, row_ss = norm or (0, 0, 0)
        if norm is not None and (hidden % 16 or not (int(norm_w) and int(normed) and int(row_ss))):
            raise ValueError(f"embedding: the handed-over norm needs hidden % 16 == 0 (got {hidden}) and its "
                             f"weight, normed and row_ss pointers")
        args = (out, table, token_ids, fed_rows, fed_ids, num_tokens, hidden, vocab_size, norm_w, normed, row_ss,
                head_argmax)
        if scale is None and not norm_offset:
            self._launch("embedding_gather", num_tokens, EMBEDDING["THREADS"], *args)
        else:
            self._launch("embedding_gather_scaled", num_tokens, EMBEDDING["THREADS"], *args,
                         1.0 if scale is None else float(scale), float(norm_offset))

    def rms_norm(self, out, x, weight, num_rows: int, hidden: int, eps: float, rows=0,
                 weight_offset: float = 0.0) -> None:
        """out[r] = RMSNorm(x[rows[r] if rows else r]) * (weight_offset + weight) (Gemma 3's
        offset 1: rms_norm_offset); one block per output row."""
        if hidden > RMS_NORM["MAX_HIDDEN"]:
            raise ValueError(f"rms_norm: hidden {hidden} is above the kernel's MAX_HIDDEN {RMS_NORM['MAX_HIDDEN']}")
        if weight_offset:
            self._launch("rms_norm_offset", num_rows, RMS_NORM["THREADS"], out, x, weight, rows, num_rows, hidden,
                         eps, float(weight_offset))
        else:
            self._launch("rms_norm", num_rows, RMS_NORM["THREADS"], out, x, weight, rows, num_rows, hidden, eps)

    def rms_norm_residual_add(self, hidden, x, weight, num_rows: int, hidden_size: int, eps: float,
                              weight_offset: float = 0.0, hand_over=None) -> None:
        """hidden[r] = bf16(hidden[r] + bf16(RMSNorm(x[r]) * (weight_offset + weight))): Gemma 3's
        norms of the attention and MLP outputs added into the residual stream. hand_over =
        (next_weight, normed, row_ss): the norm after it handed over, as gemv_residual_norm()
        hands it over (normed = bf16(hidden * (weight_offset + next_weight)), row_ss fp32
        [num_rows, hidden_size / 16]). One block per row; hidden_size % 16 == 0."""
        if hidden_size % 16 or hidden_size > RMS_NORM["MAX_HIDDEN"]:
            raise ValueError(f"rms_norm_residual_add: hidden {hidden_size} must be a multiple of 16 and at most "
                             f"{RMS_NORM['MAX_HIDDEN']}")
        next_weight, normed, row_ss = hand_over or (0, 0, 0)
        self._launch("rms_norm_residual_add", num_rows, RMS_NORM["THREADS"], hidden, x, weight, num_rows, hidden_size,
                     eps, float(weight_offset), next_weight, normed, row_ss)

    def rope_write_kv(self, qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens: int,
                      num_q_heads: int, num_kv_heads: int, head_dim: int, *, bias=0, qk_norm=None) -> None:
        """Rotate q and k in the fused qkv rows; write k and v to the paged cache at slot_mapping.
        bias (Qwen2, 0: none): the q/k/v biases [qkv width], added to every value first
        (rope_write_kv_bias). qk_norm (Qwen3, Gemma 3) = (q_norm, k_norm, eps, weight_offset):
        each q and k head RMS-normalised before RoPE, times (weight_offset + w) (rope_write_kv_qk_norm)."""
        args = (qkv, k_cache, v_cache, positions, slot_mapping, inv_freq, num_tokens, num_q_heads, num_kv_heads,
                head_dim)
        if bias and qk_norm:
            raise ValueError("rope_write_kv: q/k/v biases and q/k norms together are not built (no family has both)")
        if bias:
            self._launch("rope_write_kv_bias", num_tokens, ROPE["THREADS"], *args, bias)
        elif qk_norm:
            q_norm, k_norm, eps, weight_offset = qk_norm
            self._launch("rope_write_kv_qk_norm", num_tokens, ROPE["THREADS"], *args, q_norm, k_norm, float(eps),
                         float(weight_offset))
        else:
            self._launch("rope_write_kv", num_tokens, ROPE["THREADS"], *args)

    def silu_mul(self, out, gate_up, num_tokens: int, inter: int, gelu_tanh: bool = False) -> None:
        """out = silu(gate) * up over the fused gate_up rows (gelu_tanh: Gemma 3's gelu_tanh(gate)
        * up, gelu_tanh_mul); grid-stride, at most 4 waves."""
        threads = SILU["THREADS"]
        grid = min(num_tokens * inter // 8 // threads + 1, 4 * self.num_sms)
        self._launch("gelu_tanh_mul" if gelu_tanh else "silu_mul", grid, threads, out, gate_up, num_tokens, inter)
