"""LlamaModel: the forward pass on the GPU as a readable list of kernel launches and linear()
calls on arena views. No allocation, no numpy, no hidden state: the runner fills one of the
arena's input banks before forward() (the step's `bank`) and reads the logits (or sampled ids)
after it.

Per layer (T new tokens; residual stream `hidden` in bf16), nine launches:
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
Prefill-kind steps run this layer; so does decode with EngineConfig(fused_decode=False), the
layer the guide follows chapter by chapter. A prefill-kind step's rows need not start a prompt:
a row is any sequence's new tokens at the end of its context (ForwardBatch), so a cached
prefix, a prompt chunk and a mixed step's decode row (one token, its whole context in the cache)
are the same to every launch but the attention: rope_write_kv writes each token's K/V at its
slot, and attention_prefill reads positions 0..p of each row through its block table, while the
step's leading one-token rows (the scheduler puts a mixed step's decode rows first:
StepShape.decode_rows) go through attention_decode as in a decode step: its grid splits a long
context over many blocks and serves a GQA group per block, where a prefill tile would hold one
query row and walk the whole context alone, once per query head.

The fused decode layer (_decode_layer_fused, the default for decode steps of at most 8
sequences, where every projection runs on our GEMV). A batch-1 decode step moves little data per
kernel, so its time is the chain of dependent kernels more than their bytes; the fused layer
makes the same nine steps five launches:
    qkv      = gemv_rope_kv(normed, row_ss)             RoPE + K/V write in the GEMV's epilogue
    attn_out = attention_decode(q, paged K/V)
    hidden  += gemv_residual_norm(attn_out)             + the next norm's operand and row sums
    act      = gemv_silu_mul(normed, row_ss)            silu(gate) * up in the GEMV's epilogue
    hidden  += gemv_residual_norm(act)                  + the next layer's (or the final) norm's
No rms_norm is launched: each norm is handed over by the kernel before it. A norm's scale
inv_rms is one number per row, so it comes out of the dot product; the residual GEMV before the
norm holds the new residual rows in its epilogue anyway, so it also writes bf16(hidden *
norm_weight) into `normed` and each CTA's sum of squares of its 16 columns into `norm_row_ss`,
and the GEMV after the norm reads `normed` as its X and scales its outputs by inv_rms from those
sums (gemv.cu's header; reference/kernels.py's rms_norm_linear is the formula, close to but not
the bits of rms_norm then linear). The embedding gather hands the first layer's input norm over
(it holds the new rows too), and the last down hands the final norm to the LM head
(gemv_prenormed: a decode step's rows are its sequences' last tokens), which also keeps each
row's greedy argmax key as it stores the logits (cleared by the embedding), so the sampler reads
one word per row instead of the row (head_argmax_for); docs/perf-notes.md has what it gave.

Cascade attention (docs/engine.md; cascades()): in a decode step of at least CASCADE_MIN_SEQS
sequences a full-context layer's attention is two launches, attention_decode from the shared
prefix's end (first_position) keeping each row's log-sum-exp (decode_lse), then
attention_cascade_prefix, which reads the prefix once for all rows and merges into attn_out. The
prefix length is the input bank's cascade_prefix_len (ForwardBatch.common_prefix_blocks *
block_size, 0 when the batch shares none), so one decode graph serves both kinds of step.

The o GEMV's k-split stays at most half an SM per CTA (ops.gemv_k_warps' beside_attention): its
CTAs are then resident under PDL beside the attention's few blocks, weights in hand when it ends.

The model families (tinyvllm/model_family.py) change a few of these launches, each where the
family's config asks (ModelConfig's fields), the Llama launches unchanged:
    q/k/v biases (Qwen2)        added by rope_write_kv_bias / the fused GEMV's _bias epilogue
    q/k norms (Qwen3, Gemma 3)  rope_write_kv_qk_norm; on the fused layer after a plain prenormed
                                qkv GEMV (the norm needs whole heads, a GEMV CTA holds 16 rows)
    sliding windows             the attention kernels' window variants, per layer (layer_window)
    RoPE per layer type         the layer's frequency table (DeviceWeights.inv_freq)
    Gemma 3                     embedding_gather_scaled; rms_norm_offset (x * (1 + w)); GeGLU
                                (gelu_tanh_mul, the GEMV's gelu epilogue); o and down store their
                                products (proj_out) and rms_norm_residual_add normalises them into
                                the residual, handing the next norm over on the fused layer (eight
                                launches a layer there); the query scale query_pre_attn_scalar^-1/2.

"linear" is gpu/ops/gemv.py's linear(): our GEMV for decode batches of at most 8 tokens, cuBLAS
else. Every kernel is launched through its typed launcher in gpu/ops/ (the same ones the GPU
tests call); the numpy twins of the nine-launch sequence are reference/model.py's ReferenceModel.
"""
from __future__ import annotations

import functools

from tinyvllm.config import ModelConfig
from tinyvllm.engine import batch as batch_rules
from tinyvllm.errors import TinyVLLMError
from tinyvllm.gpu.arena import INPUT_BANKS, Arena
from tinyvllm.gpu.device_weights import DeviceWeights
from tinyvllm.gpu.kv_cache import DeviceKVCache
from tinyvllm.gpu.ops import GpuOps, attention_kernels_missing
from tinyvllm.gpu.step_shape import BankInputs, StepShape
from tinyvllm.gpu.tp_layer import TensorParallelLayers
from tinyvllm.reference.kernels import bf16_round

# attention_cascade_prefix's keyword arguments, out of _attention's shape
CASCADE_SHAPE = ("num_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "scale")


class LlamaModel(TensorParallelLayers):
    def __init__(self, config: ModelConfig, weights: DeviceWeights, arena: Arena,
                 kv_cache: DeviceKVCache, ops: GpuOps):
        missing = attention_kernels_missing(config.head_dim, config.num_attention_heads, config.num_key_value_heads)
        if missing:
            raise TinyVLLMError(missing)
        self.cfg, self.w, self.arena, self.kv, self.ops = config, weights, arena, kv_cache, ops
        self.scale = config.attention_scale        # head_dim^-1/2 (Gemma 3: query_pre_attn_scalar^-1/2)
        # Gemma 3: embeddings times sqrt(hidden) in the activations' dtype, and GeGLU
        self.embed_scale = None if config.embedding_scale is None else float(bf16_round(config.embedding_scale))
        self.gelu_tanh = config.hidden_act == "gelu_tanh"
        self.qkv_width = config.q_size + 2 * config.kv_size
        H, I = config.hidden_size, config.intermediate_size
        # each layer projection's weight [n, k] by name; with the LM head's, what ops.fuses_decode asks
        self.projection_shapes = {"qkv": (self.qkv_width, H), "o": (H, config.q_size), "gate_up": (2 * I, H),
                                  "down": (H, I)}
        self.decode_gemv_shapes = {**self.projection_shapes, "lm_head": (config.vocab_size, H)}
        v = arena.view
        self.hidden, self.normed, self.qkv, self.attn_out = v("hidden"), v("normed"), v("qkv"), v("attn_out")
        self.gate_up, self.act, self.final_normed, self.logits = v("gate_up"), v("act"), v("final_normed"), v("logits")
        self.proj_out = v("proj_out")         # o's and down's products before their norms (Gemma 3)
        self.partial_out, self.partial_ml = v("decode_partial_out"), v("decode_partial_ml")
        self.split_counters = v("decode_split_counters")
        self.decode_lse = v("decode_lse")     # cascade: the suffix's log-sum-exp for the prefix's merge
        # cascade: the prefix kernel's split partials and counters
        self.cascade_workspace = (v("cascade_partial_o"), v("cascade_partial_ml"), v("cascade_split_counters"))
        self.inputs = [BankInputs.of(arena, bank) for bank in range(INPUT_BANKS)]   # by StepShape.bank
        self.sampled_ids = v("sampled_ids")   # async scheduling's fed ids
        self.norm_row_ss = v("norm_row_ss")   # the handed-over norm's sums of squares
        self.head_argmax = v("head_argmax")   # the decode LM head's greedy argmax keys
        # tensor parallelism: all_reduce(ptr, count) sums bf16s in place over one rank (set by
        # parallel/workers.py); over more ranks tp (tp_layer.TensorParallelRank) runs the forward
        self.all_reduce = None
        # quantized weights (QuantMatrix): every GEMV launcher reads them with its kind's kernel
        # (gpu/ops/quant_gemv.py), which picks its own k-split
        self.quantized = weights.quantized
        ops.use_dequant_scratch(weights.dequant_scratch, weights.dequant_scratch_elems)
        self.tp = None

    def head_argmax_for(self, step: StepShape) -> int:
        """The device pointer of the greedy argmax keys this step's LM head keeps beside the
        logits (the decode LM head on the handed-over norm: gemv_prenormed_bf16), for the sampler
        to read instead of the logits' argmax pass; 0 when this step's head keeps none."""
        return int(self.head_argmax) if self.fused(step) else 0

    def fused(self, step: StepShape) -> bool:
        """Whether this step runs the fused decode layer (module docstring; ops.fuses_decode)."""
        return not step.is_prefill and self.ops.fuses_decode(step.num_tokens, self.decode_gemv_shapes,
                                                             self.cfg.head_dim)

    def forward(self, step: StepShape) -> None:
        """Run all layers for the step's tokens; logits of each sequence's last token land in
        the arena's `logits` view, fp32 [num_seqs, vocab] (and, where head_argmax_for(step) is
        non-zero, their greedy argmax keys in `head_argmax`)."""
        c, w, ops = self.cfg, self.w, self.ops
        T, H, eps = step.num_tokens, c.hidden_size, c.rms_norm_eps
        fused = self.fused(step)
        # each projection's GEMV k-split (ignored where linear() goes to cuBLAS, as at prefill)
        kw = {name: None if self.quantized else ops.decode_k_warps(name, n, k)
              for name, (n, k) in self.projection_shapes.items()}
        if fused and T != step.num_seqs:
            raise TinyVLLMError(f"a decode step has one token per sequence, got {T} tokens for {step.num_seqs}")
        inputs = self.inputs[step.bank]
        tok = inputs.tokens[step.is_prefill]
        if self.tp is not None:
            return self._tp_forward(step, fused, kw)
        # fused: the embedding hands the first layer's input norm over and clears the LM head's
        # greedy argmax keys (module docstring)
        ops.embedding(self.hidden, w.embed, tok.token_ids, T, H, c.vocab_size, fed_rows=tok.fed_rows,
                      fed_ids=self.sampled_ids,
                      norm=(w.layers[0].input_norm, self.normed, self.norm_row_ss) if fused else None,
                      head_argmax=self.head_argmax if fused else 0, scale=self.embed_scale,
                      norm_offset=c.norm_weight_offset)
        self.sum_hidden_over_ranks(T)
        for layer, lw in enumerate(w.layers):
            if fused:
                self._decode_layer_fused(step, layer, lw, kw)
            else:
                self._layer(step, layer, lw, kw)
        S = step.num_seqs
        if fused:   # the final norm handed over by the last down (a decode step's rows are all last tokens)
            ops.gemv(self.logits, self.normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32", last=True,
                     prenormed=(self.norm_row_ss, eps), head_argmax=self.head_argmax)
            return
        ops.rms_norm(self.final_normed, self.hidden, w.final_norm, S, H, eps, rows=inputs.last_token_idx,
                     weight_offset=c.norm_weight_offset)
        ops.linear(self.logits, self.final_normed, w.lm_head, S, c.vocab_size, H, out_dtype="float32", last=True)

    def _layer(self, step: StepShape, layer: int, lw, kw: dict[str, int]) -> None:
        """One layer in the nine launches of the module docstring (Gemma 3: with its norms of the
        attention and MLP outputs, _residual)."""
        c, ops = self.cfg, self.ops
        T, H, I, eps, offset = step.num_tokens, c.hidden_size, c.intermediate_size, c.rms_norm_eps, c.norm_weight_offset
        ops.rms_norm(self.normed, self.hidden, lw.input_norm, T, H, eps, weight_offset=offset)
        ops.linear(self.qkv, self.normed, lw.qkv, T, self.qkv_width, H, k_warps=kw["qkv"])
        self._rope_write_kv(step, layer, lw)
        self._attention(step, layer)
        self._residual(self.attn_out, lw.o, c.q_size, lw.post_norm, T, kw["o"])
        mlp_norm = lw.pre_mlp_norm if c.sandwich_norms else lw.post_norm
        ops.rms_norm(self.normed, self.hidden, mlp_norm, T, H, eps, weight_offset=offset)
        ops.linear(self.gate_up, self.normed, lw.gate_up, T, 2 * I, H, k_warps=kw["gate_up"])
        ops.silu_mul(self.act, self.gate_up, T, I, gelu_tanh=self.gelu_tanh)
        self._residual(self.act, lw.down, I, lw.post_mlp_norm, T, kw["down"])

    def _residual(self, x, w: int, k: int, out_norm: int, T: int, k_warps: int) -> None:
        """hidden += x @ W^T (linear()'s beta = 1); with Gemma 3's sandwich norms hidden +=
        norm(x @ W^T), the product stored in proj_out and added by rms_norm_residual_add."""
        c, H = self.cfg, self.cfg.hidden_size
        if self.tp is not None:
            return self._tp_residual(x, w, k, out_norm, T, k_warps)
        if not c.sandwich_norms:
            self.ops.linear(self.hidden, x, w, T, H, k, accumulate=True, k_warps=k_warps)
        else:
            self.ops.linear(self.proj_out, x, w, T, H, k, k_warps=k_warps)
            self.ops.rms_norm_residual_add(self.hidden, self.proj_out, out_norm, T, H, c.rms_norm_eps,
                                           c.norm_weight_offset)
        self.sum_hidden_over_ranks(T)

    def sum_hidden_over_ranks(self, T: int) -> None:
        """The all-reduce of `hidden` after the embedding and after each o / down projection's
        residual add (tinyvllm/parallel/sharding.py's ALL_REDUCES); nothing without a group.
        With one rank it changes nothing; over more, tp_layer.py sums the products instead."""
        if self.all_reduce is not None:
            self.all_reduce(int(self.hidden), T * self.cfg.hidden_size)

    def _decode_layer_fused(self, step: StepShape, layer: int, lw, kw: dict[str, int]) -> None:
        """One layer in five launches, every norm handed over (module docstring): `normed` and
        `norm_row_ss` hold this layer's input norm when it starts and the next layer's (or, after
        the last, the final norm's) when it ends. kw: each projection's k-split (forward())."""
        c, w, ops = self.cfg, self.w, self.ops
        T, H, I, eps = step.num_tokens, c.hidden_size, c.intermediate_size, c.rms_norm_eps
        prenormed = (self.norm_row_ss, eps)
        tok = self.inputs[step.bank].tokens[False]
        if c.qk_norm:       # the q/k norm needs whole heads: the product stored, then rope_write_kv's
            ops.gemv(self.qkv, self.normed, lw.qkv, T, self.qkv_width, H, prenormed=prenormed, k_warps=kw["qkv"])
            self._rope_write_kv(step, layer, lw)
        else:
            ops.gemv_rope_kv(self.qkv, self.normed, lw.qkv, T, self.qkv_width, H, self.kv.k(layer), self.kv.v(layer),
                             tok.positions, tok.slot_mapping, w.inv_freq(c, layer),
                             num_q_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                             head_dim=c.head_dim, prenormed=prenormed, k_warps=kw["qkv"], bias=lw.qkv_bias)
        self._attention(step, layer)
        mlp_norm = lw.pre_mlp_norm if c.sandwich_norms else lw.post_norm
        self._residual_handing_over(self.attn_out, lw.o, c.q_size, lw.post_norm, mlp_norm, T, kw["o"])
        ops.gemv_silu_mul(self.act, self.normed, lw.gate_up, T, 2 * I, H, prenormed=prenormed, k_warps=kw["gate_up"],
                          gelu_tanh=self.gelu_tanh)
        next_norm = w.layers[layer + 1].input_norm if layer + 1 < len(w.layers) else w.final_norm
        self._residual_handing_over(self.act, lw.down, I, lw.post_mlp_norm, next_norm, T, kw["down"])

    def _residual_handing_over(self, x, w: int, k: int, out_norm: int, next_norm: int, T: int, k_warps: int) -> None:
        """_residual on the fused layer, handing the norm after it (weight next_norm) over:
        gemv_residual_norm; with sandwich norms the GEMV's product, then rms_norm_residual_add,
        which hands it over in the GEMV's stead (the output's norm needs the whole row first)."""
        c, H, hand_over = self.cfg, self.cfg.hidden_size, (next_norm, self.normed, self.norm_row_ss)
        if self.tp is not None:
            return self._tp_residual(x, w, k, out_norm, T, k_warps, hand_over)
        if not c.sandwich_norms:
            self.ops.gemv_residual_norm(self.hidden, x, w, T, H, k, *hand_over, k_warps=k_warps)
        else:
            self.ops.gemv(self.proj_out, x, w, T, H, k, k_warps=k_warps)
            self.ops.rms_norm_residual_add(self.hidden, self.proj_out, out_norm, T, H, c.rms_norm_eps,
                                           c.norm_weight_offset, hand_over=hand_over)
        self.sum_hidden_over_ranks(T)

    def _rope_write_kv(self, step: StepShape, layer: int, lw) -> None:
        """RoPE on the qkv rows (the layer type's frequencies) and the K/V cache write, with the
        family's q/k/v biases (Qwen2) or q/k norms (Qwen3, Gemma 3) first."""
        c, tok = self.cfg, self.inputs[step.bank].tokens[step.is_prefill]
        qk_norm = (lw.q_norm, lw.k_norm, c.rms_norm_eps, c.norm_weight_offset) if c.qk_norm else None
        self.ops.rope_write_kv(self.qkv, self.kv.k(layer), self.kv.v(layer), tok.positions, tok.slot_mapping,
                               self.w.inv_freq(c, layer), step.num_tokens, c.num_attention_heads,
                               c.num_key_value_heads, c.head_dim, bias=lw.qkv_bias, qk_norm=qk_norm)

    def _attention(self, step: StepShape, layer: int) -> None:
        c, inputs = self.cfg, self.inputs[step.bank]
        paged = (self.kv.k(layer), self.kv.v(layer), inputs.block_tables, inputs.block_table_width)
        shape = dict(num_seqs=step.num_seqs, num_q_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     block_size=self.kv.block_size, scale=self.scale, window=c.layer_window(layer))
        decode = functools.partial(self.ops.attention_decode, self.attn_out, self.partial_out, self.partial_ml,
                                   self.split_counters, self.qkv, self.qkv_width, *paged, inputs.context_lens)
        if step.is_prefill:
            # a mixed step: its decode rows (rows 0 .. D - 1, token t = row t) through the split
            # decode attention, as in a decode step; the prompt rows after them through the
            # prefill tiles, the per-row inputs read from row D on (attention_prefill's query_start
            # holds token indices, so q and out stay whole)
            D = step.decode_rows
            if D:
                decode(**{**shape, "num_seqs": D})
            if D < step.num_seqs:
                self.ops.attention_prefill(self.attn_out, self.qkv, self.qkv_width, self.kv.k(layer), self.kv.v(layer),
                                           int(inputs.block_tables) + 4 * D * step.table_width,
                                           inputs.block_table_width, int(inputs.query_start) + 4 * D,
                                           int(inputs.context_lens) + 4 * D,
                                           max_query_len=step.max_query_len, **{**shape, "num_seqs": step.num_seqs - D})
        elif not self.cascades(step, layer):
            decode(**shape)
        else:
            # cascade (module docstring): each sequence's own positions from the shared prefix's
            # end, then the prefix once for all of them, merged into attn_out; both read the
            # prefix length from the bank (0: whole contexts, and the prefix kernel does nothing)
            decode(**shape, first_position=inputs.cascade_prefix_len, lse_out=self.decode_lse)
            self.ops.attention_cascade_prefix(self.attn_out, self.decode_lse, *self.cascade_workspace, self.qkv,
                                              self.qkv_width, self.kv.k(layer), self.kv.v(layer), inputs.block_tables,
                                              inputs.cascade_prefix_len, **{k: shape[k] for k in CASCADE_SHAPE})

    def cascades(self, step: StepShape, layer: int) -> bool:
        """Whether this layer's attention in this step is cascade's two launches: decode steps of
        at least CASCADE_MIN_SEQS sequences (a smaller batch never shares: engine/batch.py's
        rule), on layers without a sliding window (as reference/model.py). Whether the step's
        batch shares a prefix is on the device (cascade_prefix_len), so a graph holds both
        launches either way; smaller graphs (batch 1 among them) hold neither. The rule is read at
        each call (graphs capture it), so tests can lower it."""
        return (not step.is_prefill and step.num_seqs >= batch_rules.CASCADE_MIN_SEQS
                and not self.cfg.layer_window(layer))
