"""LlamaModel: the forward pass on the GPU as a readable list of kernel launches and linear()
calls on arena views. No allocation, no numpy, no hidden state: the runner fills one of the
arena's input banks before forward() (the step's `bank`) and reads the logits (or sampled ids)
after it.

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

At decode (every projection on our GEMV, T <= 8) the same nine steps run as five to seven
launches (_decode_layer_fused; TINYVLLM_FUSE=0 keeps the nine): RoPE + cache write move into
the qkv GEMV's epilogue and silu_mul into the gate_up GEMV's epilogue, which removes two
dependent stages per layer (a batch-1 step is launch-bound: docs/perf-notes.md), and a norm
can go inside the GEMV after it, which removes one more each. A norm's scale inv_rms is one
number per row, so it comes out of the dot product: the GEMV reads `hidden` itself, feeds the
tensor cores bf16(hidden * norm_weight), sums the squares of the values it loads (its warps
split K, so together they read the whole row anyway) and multiplies each output by inv_rms
before its epilogue — no extra memory round trip (gemv.cu's header). That changes bits against
rms_norm then GEMV (reference/kernels.py: rms_norm_linear is the formula). It pays on small
GEMVs only (every CTA re-reads and scales all of x): ops.fuses_norm holds the measured rule
(SmolLM2's norms go inside, Llama-1B's stay separate launches, with the bits of the nine).

By default (TINYVLLM_FUSE_NORM=producer) each norm is handed over instead: the residual
GEMV before it (o, or the previous layer's down: gemv_residual_norm) already holds the new
residual rows in its epilogue, so it also writes bf16(hidden * norm_weight) into `normed` and
each CTA's sum of squares of its 16 columns into `norm_row_ss`; the GEMV after the norm reads
`normed` as a plain X, copies the row sums into shared memory with its first X chunks and scales
its outputs by inv_rms (prenormed). The formula is the norm-inside one (rms_norm_linear), with no
per-CTA work on x. The first layer's input norm is handed over by the embedding gather (it holds
the new rows too), and the final norm by the last layer's down to the LM head (gemv_prenormed: a
decode step's rows are its sequences' last tokens), so a decode step launches no rms_norm.
Measured against norms separate (1B) or inside (SmolLM2): 975 -> 1,004 and 2,236 -> 2,276
decode tok/s (H100, docs/perf-notes.md, session 11, with the first and final norms still
launched). TINYVLLM_FUSE_NORM=auto gives the rule above back. That LM head also keeps each
row's greedy argmax key as it stores the logits (gemv_prenormed_bf16's head_argmax, cleared by
the embedding), so the sampler reads one word per row instead of the row (head_argmax_for).

The o GEMV follows the attention, whose few blocks (num_kv_heads at batch 1) hold some SMs; its
k-split stays at most half an SM per CTA (ops.gemv_k_warps' beside_attention), so all its CTAs
are resident under PDL while the attention runs and hold their weights when it ends.

TINYVLLM_L2_PREFETCH=1 makes the fused layer's attention warm L2 (attention_decode's
l2_prefetch): at batch 1 it is num_kv_heads blocks for ~4 us that leave HBM nearly idle, so
extra blocks of its grid prefetch the o weight and then the start of gate_up,
L2_PREFETCH_BYTES in all, for the o GEMV (and part of gate_up's) to read from L2. The prefetch
is issued before the attention waits for the qkv GEMV (the weights are written by no kernel)
and writes nothing: it changes no bit, only when bytes arrive. Off by default: measured on the
H200 it gained nothing (docs/perf-notes.md, session 7); it stays for the next tuning.

"linear" is gpu/ops.py's linear(): our GEMV for decode batches of at most 8 tokens, cuBLAS
else. Every kernel is launched through its typed launcher in gpu/ops.py (the same ones the GPU
tests call); the numpy twins of this exact sequence are reference/model.py's ReferenceModel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tinyvllm.config import ModelConfig
from tinyvllm.errors import TinyVLLMError
from tinyvllm.gpu.arena import INPUT_BANKS, TOKEN_INPUTS, Arena
from tinyvllm.gpu.device_weights import DeviceWeights
from tinyvllm.gpu.kv_cache import DeviceKVCache
from tinyvllm.gpu.ops import DECODE_GROUPS, DECODE_HEAD_DIMS, GpuOps

# The most weight bytes the decode attention prefetches into L2 per layer (_l2_prefetch): its
# ~4 us of nearly idle HBM at batch 1 (Llama-3.2-1B, H200) is ~16 MB at ~4 TB/s, enough for o
# (8.4 MB) and the first ~7.6 MB of gate_up. It stays well inside the 50 MB L2: between the
# prefetch and gate_up's GEMV only the o GEMV (reading the prefetched lines) and a norm run.
L2_PREFETCH_BYTES = 16 << 20


@dataclass(frozen=True)
class StepShape:
    """What the host passes to the kernels besides the arena's contents: the only per-step
    launch parameters. A decode step's shape depends on num_seqs alone, so one captured CUDA
    graph per batch size and input bank serves every decode step of that size."""
    num_tokens: int
    num_seqs: int
    is_prefill: bool
    max_query_len: int = 1
    bank: int = 0              # the arena input bank this step's inputs were uploaded into


@dataclass(frozen=True)
class TokenInputs:
    """Device pointers of one step's per-token inputs (arena.TOKEN_INPUTS, in its order)."""
    token_ids: int
    positions: int
    slot_mapping: int
    fed_rows: int


@dataclass(frozen=True)
class BankInputs:
    """The input views the forward pass reads, in one of the arena's input banks."""
    tokens: dict[bool, TokenInputs]     # by is_prefill: the prefill arrays or the decode_ ones
    query_start: int
    context_lens: int
    last_token_idx: int
    block_tables: int
    block_table_width: int

    @classmethod
    def of(cls, arena: Arena, bank: int) -> BankInputs:
        v = lambda name: arena.view(name, bank)  # noqa: E731
        return cls({prefill: TokenInputs(*(v(prefix + name) for name in TOKEN_INPUTS))
                    for prefill, prefix in ((True, ""), (False, "decode_"))},
                   v("query_start"), v("context_lens"), v("last_token_idx"), v("block_tables"),
                   v("block_table_width"))


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
        H, I = config.hidden_size, config.intermediate_size
        # each layer projection's weight [n, k] by name (ops.DECODE_PROJECTIONS)
        self.projection_shapes = {"qkv": (self.qkv_width, H), "o": (H, config.q_size), "gate_up": (2 * I, H),
                                  "down": (H, I)}
        v = arena.view
        self.hidden, self.normed, self.qkv, self.attn_out = v("hidden"), v("normed"), v("qkv"), v("attn_out")
        self.gate_up, self.act, self.final_normed, self.logits = v("gate_up"), v("act"), v("final_normed"), v("logits")
        self.partial_out, self.partial_ml = v("decode_partial_out"), v("decode_partial_ml")
        self.split_counters = v("decode_split_counters")
        self.inputs = [BankInputs.of(arena, bank) for bank in range(INPUT_BANKS)]   # by StepShape.bank
        self.sampled_ids = v("sampled_ids")   # async scheduling's fed ids
        self.norm_row_ss = v("norm_row_ss")   # the handed-over norm's sums of squares
        self.head_argmax = v("head_argmax")   # the decode LM head's greedy argmax keys
        self.l2_prefetch_bytes = L2_PREFETCH_BYTES      # benchmarks/decode_profile.py may vary it

    def head_argmax_for(self, step: StepShape) -> int:
        """The device pointer of the greedy argmax keys this step's LM head keeps beside the
        logits (the decode LM head on the handed-over norm: gemv_prenormed_bf16), for the sampler
        to read instead of the logits' argmax pass; 0 when this step's head keeps none."""
        return int(self.head_argmax) if self._head_prenormed(step) else 0

    def _fused(self, step: StepShape) -> bool:
        c = self.cfg
        return not step.is_prefill and self.ops.fuses_decode(step.num_tokens, c.hidden_size, self.qkv_width,
                                                             c.intermediate_size, c.head_dim)

    def _head_prenormed(self, step: StepShape) -> bool:
        """Whether the last down hands the final norm over to an LM head on the GEMV."""
        return (self._fused(step) and self.ops.fuse_norm == "producer"
                and self.ops.on_gemv(step.num_tokens, self.cfg.vocab_size, self.cfg.hidden_size))

    def forward(self, step: StepShape) -> None:
        """Run all layers for the step's tokens; logits of each sequence's last token land in
        the arena's `logits` view, fp32 [num_seqs, vocab] (and, where head_argmax_for(step) is
        non-zero, their greedy argmax keys in `head_argmax`)."""
        c, w, ops = self.cfg, self.w, self.ops
        T, H, I, eps = step.num_tokens, c.hidden_size, c.intermediate_size, c.rms_norm_eps
        fused = self._fused(step)
        # each projection's GEMV k-split (ignored where linear() goes to cuBLAS, as at prefill)
        kw = {name: ops.decode_k_warps(name, n, k) for name, (n, k) in self.projection_shapes.items()}
        # the handed-over norm (module docstring): the embedding hands over the first layer's input
        # norm, each residual GEMV the norm after it, the last down the final norm to the LM head
        # (a decode step has one token per sequence, so the final norm's rows are all of them),
        # which also keeps each row's greedy argmax key for the sampler (the embedding clears them)
        handoff = fused and ops.fuse_norm == "producer"
        head_prenormed = self._head_prenormed(step)
        final_norm = w.final_norm if head_prenormed else None
        if fused and T != step.num_seqs:
            raise TinyVLLMError(f"a decode step has one token per sequence, got {T} tokens for {step.num_seqs}")
        inputs = self.inputs[step.bank]
        tok = inputs.tokens[step.is_prefill]
        ops.embedding(self.hidden, w.embed, tok.token_ids, T, H, c.vocab_size, fed_rows=tok.fed_rows,
                      fed_ids=self.sampled_ids,
                      norm=(w.layers[0].input_norm, self.normed, self.norm_row_ss) if handoff else None,
                      head_argmax=self.head_argmax if head_prenormed else 0)
        for layer, lw in enumerate(w.layers):
            if fused:
                self._decode_layer_fused(step, layer, lw, kw, final_norm)
                continue
            ops.rms_norm(self.normed, self.hidden, lw.input_norm, T, H, eps)
            ops.linear(self.qkv, self.normed, lw.qkv, T, self.qkv_width, H, k_warps=kw["qkv"])
            ops.rope_write_kv(self.qkv, self.kv.k(layer), self.kv.v(layer), tok.positions, tok.slot_mapping,
                              w.rope_inv_freq, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            self._attention(step, layer)
            ops.linear(self.hidden, self.attn_out, lw.o, T, H, c.q_size, accumulate=True, k_warps=kw["o"])
            ops.rms_norm(self.normed, self.hidden, lw.post_norm, T, H, eps)
            ops.linear(self.gate_up, self.normed, lw.gate_up, T, 2 * I, H, k_warps=kw["gate_up"])
            ops.silu_mul(self.act, self.gate_up, T, I)
            ops.linear(self.hidden, self.act, lw.down, T, H, I, accumulate=True, k_warps=kw["down"])
        S = step.num_seqs
        if head_prenormed:
            ops.gemv(self.logits, self.normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32", last=True,
                     prenormed=(self.norm_row_ss, eps), head_argmax=self.head_argmax)
            return
        ops.rms_norm(self.final_normed, self.hidden, w.final_norm, S, H, eps, rows=inputs.last_token_idx)
        ops.linear(self.logits, self.final_normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32", last=True)

    def _decode_layer_fused(self, step: StepShape, layer: int, lw, kw: dict[str, int], final_norm=None) -> None:
        """One layer in five launches with the norms inside the qkv and gate_up GEMVs or handed
        over, seven with them separate (ops.fuses_norm decides per GEMV; separate, the bits of
        forward()'s nine). kw: each projection's k-split (forward()); final_norm: the final
        norm's gain, which the last layer's down hands over to the LM head (None: not)."""
        c, w, ops = self.cfg, self.w, self.ops
        T, H, I, eps = step.num_tokens, c.hidden_size, c.intermediate_size, c.rms_norm_eps

        handoff = ops.fuse_norm == "producer"      # the norms handed over (module docstring)

        def normed_input(norm_weight, n: int, handed_over: bool):
            """(X, norm, prenormed) for the next [n, H] GEMV: `normed` and the sums of squares
            the residual GEMV before left, the residual stream and its norm, or `normed`."""
            if handed_over:
                return self.normed, None, (self.norm_row_ss, eps)
            if ops.fuses_norm(n, H):
                return self.hidden, (norm_weight, eps), None
            ops.rms_norm(self.normed, self.hidden, norm_weight, T, H, eps)
            return self.normed, None, None

        def add_residual(x, weight, k: int, next_norm, name: str):
            """hidden += x @ weight^T; next_norm: the gain of the norm after it, handed over."""
            if next_norm is None:
                ops.linear(self.hidden, x, weight, T, H, k, accumulate=True, k_warps=kw[name])
            else:
                ops.gemv_residual_norm(self.hidden, x, weight, T, H, k, next_norm, self.normed, self.norm_row_ss,
                                       k_warps=kw[name])

        x, norm, prenormed = normed_input(lw.input_norm, self.qkv_width, handoff)   # layer 0: by the embedding
        tok = self.inputs[step.bank].tokens[False]
        ops.gemv_rope_kv(self.qkv, x, lw.qkv, T, self.qkv_width, H, self.kv.k(layer), self.kv.v(layer),  # qkv, rope
                         tok.positions, tok.slot_mapping, w.rope_inv_freq, num_q_heads=c.num_attention_heads,
                         num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, norm=norm, prenormed=prenormed,
                         k_warps=kw["qkv"])
        self._attention(step, layer, l2_prefetch=self._l2_prefetch(lw))
        add_residual(self.attn_out, lw.o, c.q_size, lw.post_norm if handoff else None, "o")             # o
        x, norm, prenormed = normed_input(lw.post_norm, 2 * I, handoff)
        ops.gemv_silu_mul(self.act, x, lw.gate_up, T, 2 * I, H, norm=norm, prenormed=prenormed,        # gate_up, silu
                          k_warps=kw["gate_up"])
        last = layer == len(w.layers) - 1          # the final norm goes to the LM head
        add_residual(self.act, lw.down, I, (final_norm if last else w.layers[layer + 1].input_norm) if handoff else None,
                     "down")                                                                            # down

    def _attention(self, step: StepShape, layer: int, l2_prefetch=None) -> None:
        c, inputs = self.cfg, self.inputs[step.bank]
        paged = (self.kv.k(layer), self.kv.v(layer), inputs.block_tables, inputs.block_table_width)
        shape = dict(num_seqs=step.num_seqs, num_q_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     block_size=self.kv.block_size, scale=self.scale)
        if step.is_prefill:
            self.ops.attention_prefill(self.attn_out, self.qkv, self.qkv_width, *paged, inputs.query_start,
                                       inputs.context_lens, max_query_len=step.max_query_len, **shape)
        else:
            self.ops.attention_decode(self.attn_out, self.partial_out, self.partial_ml, self.split_counters,
                                      self.qkv, self.qkv_width, *paged, inputs.context_lens, **shape,
                                      l2_prefetch=l2_prefetch)

    def _l2_prefetch(self, lw) -> tuple[int, int] | None:
        """(pointer, bytes) of the weights the decode attention prefetches into L2: o, then (o,
        post_norm and gate_up lie back to back: device_weights' upload order) the start of gate_up,
        at most l2_prefetch_bytes; None when ops.l2_prefetch is off."""
        if not self.ops.l2_prefetch or not self.l2_prefetch_bytes:
            return None
        c = self.cfg
        end = lw.gate_up + 2 * c.intermediate_size * c.hidden_size * 2
        if not lw.o < lw.post_norm < lw.gate_up:     # another layout: o alone
            end = lw.o + c.hidden_size * c.q_size * 2
        return lw.o, min(end - lw.o, self.l2_prefetch_bytes) // 16 * 16
