"""The one home of a Llama checkpoint's tensor names (Hugging Face layout) and of the fusions
the engine runs: per layer, q/k/v concatenated along the output dimension into one
[q + 2 kv, hidden] matrix and gate/up into one [2 inter, hidden] matrix, so a layer runs two
projections where HF runs five. The numpy reference and the GPU upload both build their
per-layer matrices with `fused_layer`, so they cannot disagree about the layout.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.config import ModelConfig

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# per-layer tensor -> the HF tensors it is made of (in concatenation order)
LAYER_PARTS = {
    "input_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, by its Hugging Face name, with its shape."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    part_shapes = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (config.q_size, h),
                   "self_attn.k_proj.weight": (config.kv_size, h), "self_attn.v_proj.weight": (config.kv_size, h),
                   "self_attn.o_proj.weight": (h, config.q_size), "post_attention_layernorm.weight": (h,),
                   "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    shapes = {EMBED: (v, h)}
    for layer in range(config.num_hidden_layers):
        shapes.update({layer_prefix(layer) + name: shape for name, shape in part_shapes.items()})
    shapes[FINAL_NORM] = (h,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    return shapes


def fused_layer(weights: dict[str, np.ndarray], layer: int, part: str) -> np.ndarray:
    """One per-layer matrix as the engine runs it (a LAYER_PARTS key), concatenated from the
    checkpoint's tensors when fused; made one at a time, so at most one extra copy exists."""
    names = [layer_prefix(layer) + n for n in LAYER_PARTS[part]]
    return weights[names[0]] if len(names) == 1 else np.concatenate([weights[n] for n in names], axis=0)


def lm_head(weights: dict[str, np.ndarray], config: ModelConfig) -> np.ndarray:
    """The output projection: the embedding table itself when the checkpoint ties them."""
    return weights[EMBED] if config.tie_word_embeddings else weights[LM_HEAD]
