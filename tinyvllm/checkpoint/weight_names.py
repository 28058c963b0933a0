"""The one home of a checkpoint's tensor names (Hugging Face layout, every family of
tinyvllm/model_family.py) and of the fusions the engine runs: per layer, q/k/v concatenated along
the output dimension into one [q + 2 kv, hidden] matrix (and their biases into one [q + 2 kv]
vector) and gate/up into one [2 inter, hidden] matrix, so a layer runs two projections where HF
runs five. The numpy reference and the GPU upload both build their per-layer tensors with
`fused_layer`, so they cannot disagree about the layout.

Per-layer parts (LAYER_PARTS keys), and which families have them (layer_parts):
  input_norm, qkv, o, post_norm, gate_up, down   every family; post_norm is HF's
                        post_attention_layernorm: the MLP's input norm on Llama, Mistral and
                        Qwen, but the norm of the attention output on Gemma 3
  qkv_bias              Qwen2 (q_proj/k_proj/v_proj.bias)
  q_norm, k_norm        Qwen3, Gemma 3 ([head_dim], shared by every head)
  pre_mlp_norm, post_mlp_norm   Gemma 3 (pre_/post_feedforward_layernorm)
"""
from __future__ import annotations

import numpy as np

from tinyvllm.config import ModelConfig
from tinyvllm.quant.weight_kinds import concat_rows

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# A multimodal checkpoint served text-only (tinyvllm/model_family.py's MULTIMODAL) keeps its
# language model's tensors under one of these in place of "model." (transformers 4.5x and 5 save
# the first, a model's own state dict has the second), an untied head as language_model.lm_head.
TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
TEXT_MODEL_HEAD = "language_model.lm_head.weight"
# per-layer tensor -> the HF tensors it is made of (in concatenation order)
LAYER_PARTS = {
    "input_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "o": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "pre_mlp_norm": ("pre_feedforward_layernorm.weight",),
    "post_mlp_norm": ("post_feedforward_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
LLAMA_PARTS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")
# families whose checkpoints store a fused tensor already, in the engine's layout (Phi3Attention's
# qkv_proj: q, k, v rows in order; Phi3MLP's gate_up_proj: gate rows, then up rows)
STORED_FUSED = {"phi3": {"qkv": ("self_attn.qkv_proj.weight",), "gate_up": ("mlp.gate_up_proj.weight",)}}


def part_names(config: ModelConfig, part: str) -> tuple[str, ...]:
    """The checkpoint tensors a per-layer part is made of, for this model's family."""
    return STORED_FUSED.get(config.family, {}).get(part, LAYER_PARTS[part])


def layer_parts(config: ModelConfig) -> tuple[str, ...]:
    """The LAYER_PARTS keys a layer of this model has."""
    return (LLAMA_PARTS + ("qkv_bias",) * config.qkv_bias + ("q_norm", "k_norm") * config.qk_norm
            + ("pre_mlp_norm", "post_mlp_norm") * config.sandwich_norms)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model's checkpoint must hold, by its Hugging Face name, with its shape."""
    h, v, i, d = config.hidden_size, config.vocab_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    shape_of = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
                "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
                "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
                "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                "self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * i, h)}
    part_shapes = {name: shape_of[name] for part in layer_parts(config) for name in part_names(config, part)}
    shapes = {EMBED: (v, h)}
    for layer in range(config.num_hidden_layers):
        shapes.update({layer_prefix(layer) + name: shape for name, shape in part_shapes.items()})
    shapes[FINAL_NORM] = (h,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    return shapes


def fused_layer(weights: dict[str, np.ndarray], layer: int, part: str, config: ModelConfig) -> np.ndarray:
    """One per-layer tensor as the engine runs it (a LAYER_PARTS key), concatenated from the
    checkpoint's tensors when fused; made one at a time, so at most one extra copy exists.
    Quantized parts stack as tinyvllm/quant/weight_kinds.py::concat_rows says."""
    names = [layer_prefix(layer) + n for n in part_names(config, part)]
    return concat_rows([weights[n] for n in names], names)


def lm_head(weights: dict[str, np.ndarray], config: ModelConfig) -> np.ndarray:
    """The output projection: the embedding table itself when the checkpoint ties them."""
    return weights[EMBED] if config.tie_word_embeddings else weights[LM_HEAD]


def stored_names(names) -> dict[str, str]:
    """{the engine's name (above): the name a checkpoint stores it under}: the names themselves, or
    a multimodal checkpoint's language model under its prefix; its other tensors are left out."""
    names = set(names)
    if EMBED in names:
        return {n: n for n in names}
    prefix = next((p for p in TEXT_MODEL_PREFIXES if p + EMBED[len("model."):] in names), None)
    if prefix is None:
        return {n: n for n in names}
    found = {"model." + n[len(prefix):]: n for n in names if n.startswith(prefix)}
    head = next((n for n in (LM_HEAD, TEXT_MODEL_HEAD) if n in names), None)
    return {**found, LM_HEAD: head} if head else found
