"""LlamaModel: the forward pass on the GPU as a readable list of kernel launches and linear()
calls on arena views. No allocation, no numpy, no hidden state: the runner fills the arena's
input views before forward() and reads the logits (or sampled ids) after it.

Per layer (T new tokens; residual stream `hidden` in bf16):
    normed   = rms_norm(hidden)                         kernel  } norm_linear: one fused GEMV
    qkv      = normed @ Wqkv^T                          linear  } (q, k, v fused) at decode
    q, cache = rope(qkv) -> paged K/V write             kernel (RoPE fused with the cache write)
    attn_out = attention(q, paged K/V)                  kernel: prefill tiles or split decode
    hidden  += attn_out @ Wo^T                          linear, beta = 1 fuses the residual add
    normed   = rms_norm(hidden)                         kernel  } norm_linear
    gate_up  = normed @ Wgate_up^T                      linear  } (gate, up fused)
    act      = silu(gate) * up                          kernel  } silu_linear: one fused GEMV
    hidden  += act @ Wdown^T                            linear  } at decode, beta = 1
then the final norm of each sequence's last token and the LM head (fp32 logits, S rows only).
norm_linear and silu_linear (gpu/ops.py) fold the norm / activation into the GEMV's X load
when the projection runs on the GEMV (decode, T <= 8) and TINYVLLM_FUSE=1 (opt-in: slower today, perf-notes): 6 launches
per layer instead of 9, the same bits either way; `normed` and `act` are then untouched.

"linear" is gpu/ops.py's linear(): our GEMV for decode batches of at most 8 tokens, cuBLAS
else. Every kernel is launched through its typed launcher in gpu/ops.py (the same ones the GPU
tests call); the numpy twins of this exact sequence are reference/model.py's ReferenceModel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tinyvllm.config import ModelConfig
from tinyvllm.errors import TinyVLLMError
from tinyvllm.gpu.arena import Arena
from tinyvllm.gpu.device_weights import DeviceWeights
from tinyvllm.gpu.kv_cache import DeviceKVCache
from tinyvllm.gpu.ops import DECODE_GROUPS, DECODE_HEAD_DIMS, GpuOps


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
                 kv_cache: DeviceKVCache, ops: GpuOps):
        group = config.num_attention_heads // config.num_key_value_heads
        if config.head_dim not in DECODE_HEAD_DIMS or group not in DECODE_GROUPS:
            raise TinyVLLMError(f"no attention kernels for head_dim {config.head_dim} with {group} query "
                                f"heads per kv head (built: head_dim {DECODE_HEAD_DIMS}, groups {DECODE_GROUPS})")
        self.cfg, self.w, self.arena, self.kv, self.ops = config, weights, arena, kv_cache, ops
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
        c, w, ops = self.cfg, self.w, self.ops
        T, H, I, eps = step.num_tokens, c.hidden_size, c.intermediate_size, c.rms_norm_eps
        ops.embedding(self.hidden, w.embed, self.token_ids, T, H, c.vocab_size)
        for layer, lw in enumerate(w.layers):
            ops.norm_linear(self.qkv, self.hidden, lw.input_norm, lw.qkv, T, self.qkv_width, H, eps,
                            normed=self.normed)
            ops.rope_write_kv(self.qkv, self.kv.k(layer), self.kv.v(layer), self.positions, self.slot_mapping,
                              w.rope_inv_freq, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            self._attention(step, layer)
            ops.linear(self.hidden, self.attn_out, lw.o, T, H, c.q_size, accumulate=True)
            ops.norm_linear(self.gate_up, self.hidden, lw.post_norm, lw.gate_up, T, 2 * I, H, eps,
                            normed=self.normed)
            ops.silu_linear(self.hidden, self.gate_up, lw.down, T, H, I, act=self.act, accumulate=True)
        S = step.num_seqs
        ops.rms_norm(self.final_normed, self.hidden, w.final_norm, S, H, eps, rows=self.last_token_idx)
        ops.linear(self.logits, self.final_normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32")

    def _attention(self, step: StepShape, layer: int) -> None:
        c = self.cfg
        paged = (self.kv.k(layer), self.kv.v(layer), self.block_tables, self.block_table_width)
        shape = dict(num_seqs=step.num_seqs, num_q_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     block_size=self.kv.block_size, scale=self.scale)
        if step.is_prefill:
            self.ops.attention_prefill(self.attn_out, self.qkv, self.qkv_width, *paged, self.query_start,
                                       self.context_lens, max_query_len=step.max_query_len, **shape)
        else:
            self.ops.attention_decode(self.attn_out, self.partial_out, self.partial_ml, self.split_counters,
                                      self.qkv, self.qkv_width, *paged, self.context_lens, **shape)
