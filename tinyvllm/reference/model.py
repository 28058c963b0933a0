"""ReferenceModel: the forward pass of every model family in float32 numpy, built from the
kernel twins in reference/kernels.py, over a paged KV cache (and a dense full recompute for tests).

One model: the Llama decoder, branching where a family's formula differs (ModelConfig's family
fields, tinyvllm/model_family.py); each branch names the transformers 5 code it mirrors."""
from __future__ import annotations

import math

import numpy as np

from tinyvllm.checkpoint import weight_names as names
from tinyvllm.config import ModelConfig
from tinyvllm.engine.batch import ForwardBatch
from tinyvllm.hf_config import LAYER_TYPES
from tinyvllm.quant.weight_kinds import is_quantized
from tinyvllm.reference.cascade import cascade_paged_attention
from tinyvllm.reference.kernels import (
    apply_rope,
    as_f32,
    bf16_round,
    causal_gqa_attention,
    embedding,
    gelu_tanh_mul,
    linear,
    paged_attention,
    rms_norm,
    silu_mul,
    write_kv,
)
from tinyvllm.rope import rope_inv_freq


def held(weight):
    """A weight as the model holds it: a float array in float32, a quantized weight as it is."""
    return weight if is_quantized(weight) else as_f32(weight)


class ReferenceModel:
    """The forward pass in float32 numpy over a paged KV cache (and a dense twin for tests)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], round_bf16: bool = False):
        self.config = config
        self.round = bf16_round if round_bf16 else (lambda x: x)
        # float arrays widened to float32 once; quantized weights (FP8, GGUF blocks) kept as they
        # are, each linear running its own twin (reference/kernels.py::linear)
        self.embed = held(weights[names.EMBED])
        self.lm_head = held(names.lm_head(weights, config))
        self.final_norm = as_f32(weights[names.FINAL_NORM])
        self.layers = [{part: held(names.fused_layer(weights, layer, part, config)) for part in names.layer_parts(config)}
                       for layer in range(config.num_hidden_layers)]
        self.inv_freq = {kind: rope_inv_freq(config, kind) for kind in LAYER_TYPES}
        self.scale = config.attention_scale
        # Gemma3TextScaledWordEmbedding: the embedding times sqrt(hidden) cast to the embedding's
        # dtype (fp32 here; bf16 where activations are bf16)
        self.embed_scale = None if config.embedding_scale is None else self.round(np.float32(config.embedding_scale))
        # Gemma3MLP: ACT2FN["gelu_pytorch_tanh"]; every other family: SiLU
        self.gate_act = ("gelu_tanh_mul", gelu_tanh_mul) if config.hidden_act == "gelu_tanh" else ("silu_mul", silu_mul)
        # observer(twin_name, args, out): told of every twin call after it returns (tinyvllm/trace.py
        # prints them); None (the default) costs one attribute test per call
        self.observer = None
        # linear(x, w, bias=None): every projection's twin; a study of another engine's rounding
        # swaps it (tinyvllm/quant/llama_cpp_twin.py::llama_cpp_linear)
        self.linear = linear
        # tensor parallelism (tinyvllm/parallel/numpy_ranks.py): a rank's model holds shards of
        # the split weights; all_reduce sums its partial results with the other ranks' (the
        # identity on one rank), and vocab_start is the first token id of its embedding rows
        self.all_reduce = lambda x: x
        self.vocab_start = 0

    def weight_bytes(self) -> int:
        """Bytes of the weights it holds (a tied LM head counted once)."""
        return (sum(w.nbytes for layer in self.layers for w in layer.values()) + self.embed.nbytes
                + self.final_norm.nbytes + (0 if self.lm_head is self.embed else self.lm_head.nbytes))

    def _twin(self, name: str, fn, *args):
        out = fn(*args)
        if self.observer is not None:
            self.observer(name, args, out)
        return out

    def new_kv_cache(self, num_blocks: int, block_size: int) -> np.ndarray:
        c = self.config
        return np.zeros((c.num_hidden_layers, 2, num_blocks, block_size,
                         c.num_key_value_heads, c.head_dim), np.float32)

    def forward(self, batch: ForwardBatch, kv_cache: np.ndarray) -> np.ndarray:
        """Run the batch's new tokens, writing their K/V into kv_cache; -> [S, V] logits of each
        sequence's last new token."""
        def attend(layer, q, k, v):
            k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
            self._twin("write_kv", write_kv, k_cache, v_cache, k, v, batch.slot_mapping)
            window = self.config.layer_window(layer)
            if batch.common_prefix_blocks and window is None:   # a decode batch sharing a prefix
                return self._twin("cascade_paged_attention", cascade_paged_attention, q, k_cache, v_cache,
                                  batch, self.scale)
            return self._twin("paged_attention", paged_attention, q, k_cache, v_cache, batch, self.scale, window)

        hidden = self._run_layers(batch.token_ids, batch.positions, attend)
        return self._logits(hidden[batch.last_token_indices])

    def forward_full(self, token_ids) -> np.ndarray:
        """Dense recompute of one sequence without any cache: -> [T, V] logits of every token."""
        return self._logits(self.hidden_full(token_ids))

    def hidden_full(self, token_ids) -> np.ndarray:
        """forward_full's final-normed hidden states [T, H] (the LM head's input)."""
        token_ids = np.asarray(token_ids, np.int32)
        positions = np.arange(len(token_ids))

        def attend(layer, q, k, v):
            return causal_gqa_attention(q, k, v, positions, self.scale, self.config.layer_window(layer))

        return self._run_layers(token_ids, positions, attend)

    def _run_layers(self, token_ids, positions, attend) -> np.ndarray:
        c, r, op = self.config, self.round, self._twin
        t = len(token_ids)
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, offset = c.rms_norm_eps, c.norm_weight_offset      # Gemma3RMSNorm: x * (1 + w)

        def norm(x, weight):
            return r(op("rms_norm", rms_norm, x, weight, eps, offset))

        hidden = r(self.all_reduce(op("embedding", embedding, np.asarray(token_ids) - self.vocab_start,
                                      self.embed)))                          # the residual stream
        if self.embed_scale is not None:          # Gemma3TextScaledWordEmbedding.forward
            hidden = r(hidden * self.embed_scale)
        for i, w in enumerate(self.layers):
            x = norm(hidden, w["input_norm"])
            qkv = r(op("linear", self.linear, x, w["qkv"]))
            if c.qkv_bias:      # Qwen2Attention: q_proj, k_proj, v_proj with bias=True; the bias goes
                qkv = r(qkv + w["qkv_bias"])    # onto the stored product (where the GPU reads qkv)
            q, k, v = np.split(qkv, [c.q_size, c.q_size + c.kv_size], axis=1)
            q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
            if c.qk_norm:       # Qwen3Attention / Gemma3Attention: q_norm, k_norm per head, before rotary
                q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
            if i not in c.nope_layers:      # SmolLM3Attention: `if self.use_rope`
                inv_freq = self.inv_freq[c.layer_type(i)]       # Gemma3RotaryEmbedding: one per layer type
                q = r(op("apply_rope", apply_rope, q, positions, inv_freq))
                k = r(op("apply_rope", apply_rope, k, positions, inv_freq))
            attn = r(attend(i, q, k, v.reshape(t, hkv, d)))
            # the projections' outputs go into the residual unrounded (the GPU adds them in the
            # GEMM's epilogue) except where a norm reads them first
            out = self.all_reduce(op("linear", self.linear, attn.reshape(t, c.q_size), w["o"]))
            if c.sandwich_norms:     # Gemma3DecoderLayer: post_attention_layernorm on the attention output,
                hidden = r(hidden + norm(r(out), w["post_norm"]))       # pre_feedforward_layernorm
                x = norm(hidden, w["pre_mlp_norm"])                     # before the MLP
            else:                    # LlamaDecoderLayer: post_attention_layernorm before the MLP
                hidden = r(hidden + out)
                x = norm(hidden, w["post_norm"])
            gate, up = np.split(r(op("linear", self.linear, x, w["gate_up"])), 2, axis=1)
            out = self.all_reduce(op("linear", self.linear, r(op(*self.gate_act, gate, up)), w["down"]))
            if c.sandwich_norms:     # Gemma3DecoderLayer: post_feedforward_layernorm on the MLP output
                out = norm(r(out), w["post_mlp_norm"])
            hidden = r(hidden + out)
        return norm(hidden, self.final_norm)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self._twin("linear", self.linear, hidden, self.lm_head), dtype=np.float32)

    def greedy_generate(self, prompt_ids, max_new_tokens: int, stop_token_ids=(),
                        block_size: int = 16) -> list[int]:
        """Prefill the prompt, then decode one token at a time through the paged cache; argmax
        sampling. Stops early only at a token in stop_token_ids. -> the new tokens."""
        prompt = [int(t) for t in prompt_ids]
        total = len(prompt) + max_new_tokens
        num_blocks = math.ceil(total / block_size)
        # a scrambled block table, so that paging bugs cannot hide behind an identity mapping
        table = list(np.random.default_rng(0).permutation(num_blocks))
        cache = self.new_kv_cache(num_blocks, block_size)
        out: list[int] = []
        new_tokens, context = prompt, len(prompt)
        for step in range(max_new_tokens):
            batch = ForwardBatch.build([new_tokens], [context], [table], block_size,
                                       is_prefill=step == 0)
            token = int(np.argmax(self.forward(batch, cache)[0]))
            out.append(token)
            if token in stop_token_ids:
                break
            new_tokens, context = [token], context + 1
        return out
