"""LlamaModel: the forward pass on the GPU as a readable list of kernel launches and linear()
calls on arena views. No allocation, no numpy, no hidden state: the runner fills the arena's
input views before forward() and reads the logits (or sampled ids) after it.

Per layer (T new tokens; residual stream `hidden` in bf16):
    normed   = rms_norm(hidden)                         kernel
    qkv      = normed @ Wqkv^T                          linear (q, k, v fused)
    q, cache = rope(qkv) -> paged K/V write             kernel (RoPE fused with the cache write)
    attn_out = attention(q, paged K/V)                  kernel: prefill tiles or split decode
    hidden  += attn_out @ Wo^T                          linear, beta = 1 fuses the residual add
    normed   = rms_norm(hidden)                         kernel
    gate_up  = normed @ Wgate_up^T                      linear (gate, up fused)
    act      = silu(gate) * up                          kernel
    hidden  += act @ Wdown^T                            linear, beta = 1
then the final norm of each sequence's last token and the LM head (fp32 logits, S rows only).

"linear" is cuBLAS (gpu/cublas.py) except for decode batches of at most Gemv.MAX_ROWS tokens,
which use our weight-streaming GEMV (cuda/gemv.cu): at M <= 8 cuBLAS reads the small matrices
at 1.7-2.5 TB/s, far from the 4.2 TB/s the weights could stream at. TINYVLLM_GEMV=0 turns the
GEMV off (for comparisons).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tinyvllm.config import ModelConfig
from tinyvllm.errors import TinyVLLMError
from tinyvllm.gpu.arena import MAX_DECODE_SPLITS, Arena
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.device_weights import DeviceWeights
from tinyvllm.gpu.gemv import Gemv
from tinyvllm.gpu.kernels import DECODE_GROUPS, KernelLibrary
from tinyvllm.gpu.kv_cache import DeviceKVCache

NORM_THREADS = 256
PREFILL_BLOCK_Q = 64        # query rows per block of attention_prefill
ROPE_THREADS = 256
# cuBLAS streams the 525 MB LM head at 4.1 TB/s, our GEMV at 3.8 (benchmarks/gemv_bench.py,
# H200, 2026-12-02): the GEMV serves the per-layer projections only.
GEMV_MAX_N = 32768


@dataclass(frozen=True)
class StepShape:
    """What the host passes to the kernels besides the arena's contents: the only per-step
    launch parameters. A decode step's shape depends on num_seqs alone, so one captured CUDA
    graph per batch size serves every decode step of that size."""
    num_tokens: int
    num_seqs: int
    is_prefill: bool
    max_query_len: int = 1


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: DeviceWeights, arena: Arena,
                 kv_cache: DeviceKVCache, kernels: KernelLibrary, blas: Cublas, num_sms: int):
        group = config.num_attention_heads // config.num_key_value_heads
        if config.head_dim not in (64, 128) or group not in DECODE_GROUPS:
            raise TinyVLLMError(f"no attention kernels for head_dim {config.head_dim} with {group} query "
                                f"heads per kv head (built: head_dim 64/128, groups {DECODE_GROUPS})")
        self.cfg, self.w, self.arena, self.kv, self.k, self.blas = config, weights, arena, kv_cache, kernels, blas
        self.gemv = Gemv(kernels, num_sms) if os.environ.get("TINYVLLM_GEMV", "1") != "0" else None
        self.num_sms = num_sms
        self.group = group
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.qkv_width = config.q_size + 2 * config.kv_size
        v = arena.view
        self.hidden, self.normed, self.qkv, self.attn_out = v("hidden"), v("normed"), v("qkv"), v("attn_out")
        self.gate_up, self.act, self.final_normed, self.logits = v("gate_up"), v("act"), v("final_normed"), v("logits")
        self.partial_out, self.partial_ml = v("decode_partial_out"), v("decode_partial_ml")
        self.split_counters = v("decode_split_counters")
        self.token_ids, self.positions, self.slot_mapping = v("token_ids"), v("positions"), v("slot_mapping")
        self.query_start, self.context_lens = v("query_start"), v("context_lens")
        self.last_token_idx, self.block_tables = v("last_token_idx"), v("block_tables")
        self.block_table_width = v("block_table_width")

    def forward(self, step: StepShape) -> None:
        """Run all layers for the step's tokens; logits of each sequence's last token land in
        the arena's `logits` view, fp32 [num_seqs, vocab]."""
        c, w, k, linear = self.cfg, self.w, self.k, self._linear
        T, H, I = step.num_tokens, c.hidden_size, c.intermediate_size
        k["embedding_gather"](T, 128, self.hidden, w.embed, self.token_ids, T, H, c.vocab_size)
        for layer, lw in enumerate(w.layers):
            self._rms_norm(self.normed, self.hidden, lw.input_norm, T)
            linear(self.qkv, self.normed, lw.qkv, T, self.qkv_width, H)
            k["rope_write_kv"](T, ROPE_THREADS, self.qkv, self.kv.k(layer), self.kv.v(layer), self.positions,
                               self.slot_mapping, w.rope_inv_freq, T, c.num_attention_heads,
                               c.num_key_value_heads, c.head_dim)
            self._attention(step, layer)
            linear(self.hidden, self.attn_out, lw.o, T, H, c.q_size, accumulate=True)
            self._rms_norm(self.normed, self.hidden, lw.post_norm, T)
            linear(self.gate_up, self.normed, lw.gate_up, T, 2 * I, H)
            k["silu_mul"](min(T * I // 8 // 256 + 1, 4 * self.num_sms), 256, self.act, self.gate_up, T, I)
            linear(self.hidden, self.act, lw.down, T, H, I, accumulate=True)
        S = step.num_seqs
        self._rms_norm(self.final_normed, self.hidden, w.final_norm, S, rows=self.last_token_idx)
        linear(self.logits, self.final_normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32")

    def _linear(self, y, x, w, m: int, n: int, k: int, **kwargs) -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T: the GEMV for small decode batches, else cuBLAS."""
        if self.gemv is not None and n <= GEMV_MAX_N and self.gemv.supports(m, n, k):
            self.gemv.linear(y, x, w, m, n, k, **kwargs)
        else:
            self.blas.linear(y, x, w, m, n, k, **kwargs)

    def _rms_norm(self, out, inp, weight, num_rows, rows=0):
        self.k["rms_norm"](num_rows, NORM_THREADS, out, inp, weight, rows, num_rows,
                           self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def _attention(self, step: StepShape, layer: int) -> None:
        c, D = self.cfg, self.cfg.head_dim
        common = (self.kv.k(layer), self.kv.v(layer), self.block_tables, self.block_table_width)
        if step.is_prefill:
            grid = (math.ceil(step.max_query_len / PREFILL_BLOCK_Q), step.num_seqs, c.num_attention_heads)
            self.k[f"attention_prefill_d{D}"](
                grid, PREFILL_BLOCK_Q * (D // 64), self.attn_out, self.qkv, self.qkv_width, *common,
                self.query_start, self.context_lens, self.kv.block_size, c.num_key_value_heads,
                self.group, self.scale)
            return
        splits = self.decode_splits(step.num_seqs)
        self.k[f"attention_decode_d{D}_g{self.group}"](
            (step.num_seqs, c.num_key_value_heads, splits), 128, self.attn_out, self.partial_out,
            self.partial_ml, self.split_counters, self.qkv, self.qkv_width, *common,
            self.context_lens, self.kv.block_size, c.num_key_value_heads, self.scale)

    def decode_splits(self, num_seqs: int) -> int:
        """The most splits a sequence's context may use: enough blocks to fill the GPU about
        twice. It depends on the batch size only, so eager steps and graph replays run identical
        launches (bit-identical results); the kernel itself uses fewer for short contexts."""
        blocks_without_split = num_seqs * self.cfg.num_key_value_heads
        return max(1, min(math.ceil(2 * self.num_sms / blocks_without_split), MAX_DECODE_SPLITS))
