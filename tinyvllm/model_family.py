"""The model families tinyvllm serves, and what each changes from Llama, read from config.json.

Every family is the Llama decoder (RMSNorm, RoPE, grouped-query attention, a gated MLP) with a
few changes, each one a ModelConfig field:

  family          model_type    architecture         changes from Llama
  Llama 3.x       llama         LlamaForCausalLM     -
  Mistral         mistral       MistralForCausalLM   a sliding window on every layer (v0.1: 4096;
                                                     null on v0.3, which is then Llama exactly)
  Qwen2 / Qwen2.5 qwen2         Qwen2ForCausalLM     biases on q, k, v
  Qwen3           qwen3         Qwen3ForCausalLM     RMSNorm over each head of q and k before RoPE;
                                                     head_dim of its own
  SmolLM3         smollm3       SmolLM3ForCausalLM   no RoPE on some layers (no_rope_layers: every
                                                     4th by default)
  Phi-3 / Phi-4   phi3          Phi3ForCausalLM      q/k/v and gate/up stored fused (qkv_proj,
                                                     gate_up_proj); a sliding window on every layer
                                                     where config.json sets one (Phi-3-mini: 2047)
  Gemma 3 text    gemma3_text   Gemma3ForCausalLM    RMSNorm as x * (1 + w); embeddings times
                                                     sqrt(hidden); GeGLU with tanh-GELU; norms on
                                                     the attention output and around the MLP; q/k
                                                     norms; scores times query_pre_attn_scalar^-1/2;
                                                     sliding and full layers, each with its RoPE

(Qwen2 and Qwen3 have sliding windows too, off unless use_sliding_window is true.)

Gemma 3 4B, 12B and 27B (Gemma3ForConditionalGeneration, model_type gemma3), Mistral Small 3.1
and 3.2 (Mistral3ForConditionalGeneration, mistral3) and Qwen2-VL, Qwen2.5-VL and Qwen3-VL are
multimodal checkpoints: served text-only, as their language model (a Gemma 3 text model, a
Mistral, a Qwen2, a Qwen3), whose config is config.json's text_config (or, in Qwen2-VL's flat
configs, its top level; language_model_config) and whose tensors carry the language model's
prefix, if any (checkpoint/weight_names.py); on text their multimodal RoPE is plain RoPE
(hf_config.py). The vision tower is not loaded; a request with an image is refused
where requests are validated (the server's message parts are text).

The rule for fields: what the family's transformers 5 classes read is read here, with their
defaults where config.json leaves a field out (Qwen3Config's head_dim 128, MistralConfig's
sliding_window 4096, ...), so a directory loads as it does there; a value the engine cannot
honour is a ModelLoadError naming the field. A field the family's classes do not read (Mistral's
attention_bias, Llama's sliding_window) is not read here either.
"""
from __future__ import annotations

from tinyvllm.errors import ModelLoadError
from tinyvllm.hf_config import FULL, SLIDING, ConfigFields, parse_layer_ropes, parse_layer_types, parse_rope

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}
ARCHITECTURE_FAMILY = {arch: family for family, arch in FAMILIES.items()}
# head_dim when config.json has none: the config class's default (None: hidden / heads)
HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma3_text": 256}
TIED_DEFAULT = {"gemma3_text": True, "smollm3": True}   # tie_word_embeddings when absent (else False)
# the fields every family reads, when config.json leaves them out: Gemma3TextConfig's defaults (a
# multimodal Gemma 3's text_config lists only what differs from them); other families' config
# classes are always written out whole, and a missing field there stays an error
BASE_DEFAULTS = {"gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                                     num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                     rms_norm_eps=1e-6, max_position_embeddings=131_072,
                                     bos_token_id=2, eos_token_id=1)}
# multimodal model_type -> (its architecture, the family of its language model)
MULTIMODAL = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text"),
              "mistral3": ("Mistral3ForConditionalGeneration", "mistral"),
              "qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen2"),
              "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2"),
              "qwen3_vl": ("Qwen3VLForConditionalGeneration", "qwen3")}
# those whose Hub configs may be flat (the text model's fields at the top, no text_config), as
# Qwen2_5_VLConfig reads them
FLAT_TEXT_CONFIG = ("qwen2_vl", "qwen2_5_vl")
# top-level fields of a multimodal config.json that its language model reads from there
MULTIMODAL_TOP_FIELDS = ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings",
                         "bos_token_id", "eos_token_id", "pad_token_id")
SILU_NAMES = ("silu", "swish")                    # transformers' ACT2FN: the same SiLU
TANH_GELU_NAMES = ("gelu_pytorch_tanh", "gelu_python_tanh")   # ACT2FN: the same tanh-approximate GELU
GEMMA3_THETAS = (1_000_000.0, 10_000.0)           # Gemma3TextConfig.default_theta: full, sliding
DEFAULT_THETA = {"smollm3": 2_000_000.0}          # the config class's default_theta, where not 10,000


def language_model_config(cfg: dict, source: str) -> dict:
    """config.json as the engine reads it: a multimodal model's text_config with the top-level
    fields that apply to its language model (MULTIMODAL_TOP_FIELDS, the top level winning), named
    as the text family; then, for any config, the family's BASE_DEFAULTS for fields left out."""
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    multimodal = next((m for m, (arch, _) in MULTIMODAL.items()
                       if cfg.get("model_type") == m or arch in archs), None)
    if multimodal is not None:
        arch, family = MULTIMODAL[multimodal]
        text = cfg.get("text_config")
        if text is None and multimodal in FLAT_TEXT_CONFIG:
            text = {k: v for k, v in cfg.items() if k != "vision_config"}
        if not isinstance(text, dict):
            raise ModelLoadError(f"{source}: a {arch} config needs a text_config object (its language model)")
        cfg = {**text, **{k: cfg[k] for k in MULTIMODAL_TOP_FIELDS if cfg.get(k) is not None},
               "model_type": family, "architectures": [FAMILIES[family]]}
    family = cfg.get("model_type") if cfg.get("model_type") in BASE_DEFAULTS else None
    if family is None:
        family = next((f for a in archs if (f := ARCHITECTURE_FAMILY.get(a)) in BASE_DEFAULTS), None)
    if family is not None:
        cfg = {**cfg, **{k: v for k, v in BASE_DEFAULTS[family].items() if cfg.get(k) is None}}
    return cfg


def family_of(cfg: dict, source: str) -> str:
    """The family from model_type (what transformers' Auto classes go by), else from
    architectures; the two must not name different families."""
    archs = cfg.get("architectures") or []
    named = [ARCHITECTURE_FAMILY[a] for a in archs if a in ARCHITECTURE_FAMILY] if isinstance(archs, list) else []
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        if named and named[0] != model_type:
            raise ModelLoadError(f"{source}: model_type {model_type!r} and architectures {archs!r} "
                                 "name different model families")
        return model_type
    if named:
        return named[0]
    served = [*FAMILIES.values()] + [arch + " (text only)" for arch, _ in MULTIMODAL.values()]
    raise ModelLoadError(f"{source}: unsupported architecture {archs or model_type!r}; tinyvllm serves "
                         f"{', '.join(served)}")


def family_fields(family: str, cfg: dict, source: str, num_layers: int, hidden: int) -> dict:
    """The ModelConfig fields that differ between families, from config.json."""
    f = ConfigFields(cfg, source)
    if family == "gemma3_text":
        return _gemma3(cfg, f, source, num_layers, hidden)
    act = f.get("hidden_act", str, "silu")
    if act not in SILU_NAMES:
        raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} (only silu)")
    if family in ("llama", "qwen3", "smollm3") and f.get("attention_bias", bool, False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported (no bias tensors)")
    if family in ("llama", "smollm3") and f.get("mlp_bias", bool, False):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported (no bias tensors)")
    rope_theta, rope_scaling = parse_rope(cfg, source, DEFAULT_THETA.get(family))
    nope = _nope_layers(cfg, f, source, num_layers) if family == "smollm3" else ()
    window, layer_types = _windows(family, cfg, f, source, num_layers, nope)
    return dict(family=family, rope_theta=rope_theta, rope_scaling=rope_scaling, sliding_window=window,
                layer_types=layer_types, nope_layers=nope,
                qkv_bias=family == "qwen2",       # Qwen2Attention: q/k/v_proj with bias=True
                qk_norm=family == "qwen3")        # Qwen3Attention: q_norm, k_norm


def _nope_layers(cfg: dict, f: ConfigFields, source: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3Config's no_rope_layers (1: the layer applies RoPE, 0: it does not;
    SmolLM3Attention.use_rope), by default 0 on every no_rope_layer_interval-th layer."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = f.positive_int("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not (isinstance(flags, list) and len(flags) == num_layers
            and all(v in (0, 1) and not isinstance(v, float) for v in flags)):
        raise ModelLoadError(f"{source}: field 'no_rope_layers' must list {num_layers} flags of 0 or 1 "
                             f"(1: the layer applies RoPE), got {flags!r}")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _windows(family: str, cfg: dict, f: ConfigFields, source: str, num_layers: int, nope=()):
    """(sliding_window, layer_types) as the family's attention masks use them; (None, ()) when
    every layer attends to the whole context."""
    if family == "llama":
        return None, ()
    if family == "smollm3":
        # SmolLM3Config: with use_sliding_window and a sliding_window, the layers without RoPE
        # slide (unless layer_types says which)
        window = f.positive_int("sliding_window", None) if f.get("use_sliding_window", bool, False) else None
        default = [SLIDING if window and i in nope else FULL for i in range(num_layers)]
        return _normalized(window, parse_layer_types(cfg, source, num_layers, default), source)
    if family in ("mistral", "phi3"):
        # MistralModel / Phi3Model mask every layer with config.sliding_window; their configs ignore
        # layer_types (alternating layers are Ministral's), so a config that sets them is refused.
        # Absent, MistralConfig's window is 4096, Phi3Config's None.
        if cfg.get("layer_types") is not None:
            raise ModelLoadError(f"{source}: layer_types is not read by {FAMILIES[family]} (every layer "
                                 "has the same attention); remove it")
        absent = 4096 if family == "mistral" else None
        window = f.positive_int("sliding_window", None) if "sliding_window" in cfg else absent
        return _normalized(window, (SLIDING,) * num_layers if window else (), source)
    # Qwen2Config / Qwen3Config: the window only with use_sliding_window, on the layers from
    # max_window_layers on (unless layer_types says which)
    use = f.get("use_sliding_window", bool, False)
    window = f.positive_int("sliding_window", None) if use else None
    first = f.get("max_window_layers", int, 28)
    default = [SLIDING if window and i >= first else FULL for i in range(num_layers)]
    return _normalized(window, parse_layer_types(cfg, source, num_layers, default), source)


def _normalized(window, layer_types, source):
    if SLIDING not in layer_types:
        return None, ()
    if window is None:
        raise ModelLoadError(f"{source}: layer_types names sliding_attention layers but there is no "
                             "sliding_window (null, or use_sliding_window is false)")
    return window, tuple(layer_types)


def _gemma3(cfg: dict, f: ConfigFields, source: str, num_layers: int, hidden: int) -> dict:
    """Gemma3TextConfig's fields (modeling_gemma3.py: Gemma3TextModel, Gemma3DecoderLayer,
    Gemma3Attention, Gemma3RMSNorm, Gemma3MLP)."""
    act = f.get("hidden_activation", str, "gelu_pytorch_tanh")
    if act not in TANH_GELU_NAMES:
        raise ModelLoadError(f"{source}: unsupported hidden_activation {act!r} (only gelu_pytorch_tanh)")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(name) is not None:
            raise ModelLoadError(f"{source}: {name}={cfg[name]!r} is not supported (no logit soft-capping)")
    if f.get("use_bidirectional_attention", bool, False):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported (causal attention only)")
    if f.get("attention_bias", bool, False):
        raise ModelLoadError(f"{source}: attention_bias=true is not supported (no bias tensors)")
    # without layer_types: every sliding_window_pattern-th layer is a full one (4.x configs)
    pattern = f.positive_int("sliding_window_pattern", 6)
    default = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    window = f.positive_int("sliding_window", None) if "sliding_window" in cfg else 4096
    window, layer_types = _normalized(window, parse_layer_types(cfg, source, num_layers, default), source)
    ropes = parse_layer_ropes(cfg, source, *GEMMA3_THETAS)
    return dict(
        family="gemma3_text", rope_theta=ropes[FULL][0], rope_scaling=ropes[FULL][1],
        sliding_rope_theta=ropes[SLIDING][0], sliding_rope_scaling=ropes[SLIDING][1],
        sliding_window=window, layer_types=layer_types,
        qk_norm=True,                          # Gemma3Attention: q_norm, k_norm
        norm_weight_offset=1.0,                # Gemma3RMSNorm: x * (1 + w)
        sandwich_norms=True,                   # Gemma3DecoderLayer: four norms per layer
        hidden_act="gelu_tanh",                # Gemma3MLP: ACT2FN["gelu_pytorch_tanh"]
        embedding_scale=hidden ** 0.5,         # Gemma3TextScaledWordEmbedding: embed_scale
        query_pre_attn_scalar=f.positive_float("query_pre_attn_scalar", 256.0),   # Gemma3Attention.scaling
    )
