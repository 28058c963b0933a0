"""Reading Hugging Face config.json fields: typed reads that name the field in every error, the
dtype under either of its names, and RoPE in either of its forms.

transformers 4.x writes RoPE as a top-level `rope_theta` plus an optional `rope_scaling` dict and
the dtype as `torch_dtype`; transformers 5.x writes one `rope_parameters` dict ({"rope_type",
"rope_theta", and the scaling fields}) and `dtype`. Both are read; a value given in both forms
must agree. A rope type or field we do not implement is a ModelLoadError naming it.

Gemma 3 gives each kind of layer its own RoPE: transformers 5 keys rope_parameters by layer type
({"full_attention": {...}, "sliding_attention": {...}}); its 4.x configs say `rope_theta` and
`rope_scaling` for the full-attention layers and `rope_local_base_freq` for the sliding ones
(parse_layer_ropes reads both forms)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tinyvllm.errors import ModelLoadError

# transformers' default (RotaryEmbeddingConfigMixin.default_theta: Llama, Mistral, Qwen2, Qwen3)
# when a config names no theta in either form; followed so that such a directory loads as there.
DEFAULT_ROPE_THETA = 10000.0
DTYPES = ("bfloat16", "float16", "float32")      # what weights.py reads (all served as bf16)
# rope_parameters / rope_scaling keys each rope type may carry ("type" is the pre-4.45 name
# of "rope_type"); any other key is a feature we do not implement.
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# mrope_section / mrope_interleaved: the multimodal RoPE of Qwen2-VL, Qwen2.5-VL and Qwen3-VL splits
# the head's frequencies among three position streams (time, height, width); on text the three
# are the same position, so it is this plain RoPE exactly (transformers too names "mrope" default)
ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
                         "mrope_interleaved"}}
ROPE_KEYS["llama3"] = ROPE_KEYS["default"] | set(LLAMA3_FIELDS)
ROPE_KEYS["linear"] = ROPE_KEYS["default"] | {"factor"}
YARN_FIELDS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim", "truncate")
ROPE_KEYS["yarn"] = ROPE_KEYS["default"] | set(YARN_FIELDS)
# what each layer of a model with layer_types does (transformers' names)
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling ("rope_type": "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation ("rope_type": "linear"): every frequency divided by `factor`
    (transformers' _compute_linear_scaling_rope_parameters), as Gemma 3 4B's full layers do."""
    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN ("rope_type": "yarn"; transformers' _compute_yarn_parameters): each frequency blended
    between itself (extrapolation) and itself / factor (interpolation) by a linear ramp over the
    dimensions that turn between beta_fast and beta_slow times in the original context, and the
    scores q.k times attention_factor^2 (transformers multiplies cos and sin by attention_factor;
    ModelConfig.attention_scale folds its square into the softmax scale instead)."""
    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context stretched `factor` times (its Eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# a RoPE: (theta, its scaling or None)
Rope = tuple[float, RopeScaling | LinearRopeScaling | YarnRopeScaling | None]
KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class ConfigFields:
    """Typed reads of config.json fields: a wrong type or range is a ModelLoadError naming the
    field (JSON booleans are not numbers here, though Python's bool is an int)."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get(self, key: str, kind, default=..., where: str = ""):
        value = self.cfg.get(key)
        if value is None:
            if default is ...:
                raise ModelLoadError(f"{self.source}: missing required field {where + key!r}")
            return default
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ModelLoadError(f"{self.source}: field {where + key!r} must be {KIND_NAMES[kind]}, "
                                 f"got {value!r}")
        return float(value) if kind is float else value

    def positive_int(self, key: str, default=...) -> int:
        value = self.get(key, int, default)
        if value is None:                 # absent, and the caller's default is None
            return None
        if value < 1:
            raise ModelLoadError(f"{self.source}: field {key!r} must be positive, got {value}")
        return value

    def positive_float(self, key: str, default=..., where: str = "") -> float:
        value = self.get(key, float, default, where)
        if value is None:                 # absent, and the caller's default is None
            return None
        if not value > 0 or not math.isfinite(value):
            raise ModelLoadError(f"{self.source}: field {where + key!r} must be a positive number, got {value}")
        return value

    def token_ids(self, key: str, allow_list: bool):
        value = self.cfg.get(key)
        ids = value if allow_list and isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelLoadError(f"{self.source}: field {key!r} must be a token id"
                                 f"{' or a list of them' if allow_list else ''}, got {value!r}")
        return tuple(ids) if allow_list else (ids[0] if ids else None)


def parse_dtype(cfg: dict, source: str) -> str:
    given = {k: cfg[k] for k in ("dtype", "torch_dtype") if cfg.get(k) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise ModelLoadError(f"{source}: dtype={given['dtype']!r} and torch_dtype="
                             f"{given['torch_dtype']!r} disagree")
    dtype = next(iter(given.values()), "bfloat16")
    if dtype not in DTYPES:
        raise ModelLoadError(f"{source}: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return dtype


def parse_rope(cfg: dict, source: str, default_theta: float | None = None) -> Rope:
    """(theta, scaling or None) from either form. transformers 5 lets rope_scaling
    override rope_parameters; here two forms present at once must say the same thing. With no
    theta anywhere: default_theta (the config class's), else DEFAULT_ROPE_THETA."""
    forms = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ModelLoadError(f"{source}: field {key!r} must be an object, got {value!r}")
        if value:
            forms[key] = rope_from_dict(value, key, source)
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor={cfg['partial_rotary_factor']!r} is not "
                             "supported (RoPE on the whole head only)")
    top_theta = ConfigFields(cfg, source).positive_float("rope_theta", None)
    if len(forms) == 2 and forms["rope_parameters"][1] != forms["rope_scaling"][1]:
        raise ModelLoadError(f"{source}: rope_scaling and rope_parameters disagree; remove one")
    thetas = {k: theta for k, (theta, _) in forms.items() if theta is not None}
    if top_theta is not None:
        thetas["rope_theta"] = top_theta
    if len(set(thetas.values())) > 1:
        raise ModelLoadError(f"{source}: conflicting rope_theta values "
                             f"({', '.join(f'{k}: {v:g}' for k, v in thetas.items())})")
    theta = next(iter(thetas.values()), default_theta or DEFAULT_ROPE_THETA)
    scaling = next((s for _, s in forms.values()), None)
    return theta, scaling


def rope_from_dict(params: dict, key: str, source: str) -> tuple[float | None, RopeScaling | LinearRopeScaling | None]:
    kinds = {params[k] for k in ("rope_type", "type") if isinstance(params.get(k), str)}
    if any(params.get(k) is not None and not isinstance(params[k], str) for k in ("rope_type", "type")):
        raise ModelLoadError(f"{source}: {key}.rope_type must be a string, got {params.get('rope_type')!r}")
    if len(kinds) > 1:
        raise ModelLoadError(f"{source}: {key} has both rope_type and type, and they differ ({kinds})")
    kind = next(iter(kinds), "default")
    kind = "default" if kind == "mrope" else kind     # Qwen2_5_VLTextConfig.convert_rope_params_to_dict
    if kind not in ROPE_KEYS:
        raise ModelLoadError(f"{source}: unsupported rope type {kind!r} in {key} "
                             f"(tinyvllm implements: {', '.join(ROPE_KEYS)})")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise ModelLoadError(f"{source}: {key} field {unknown[0]!r} is not supported for rope type {kind!r}")
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: {key}.partial_rotary_factor={params['partial_rotary_factor']!r} "
                             "is not supported (RoPE on the whole head only)")
    f = ConfigFields(params, source)
    where = f"{key}."
    theta = f.positive_float("rope_theta", None, where)
    if kind == "default":
        return theta, None
    if kind == "linear":
        if params.get("factor") is None:
            raise ModelLoadError(f"{source}: {key} of type linear is missing 'factor'")
        return theta, LinearRopeScaling(f.positive_float("factor", where=where))
    if kind == "yarn":
        return theta, _yarn(params, f, key, source)
    missing = [name for name in LLAMA3_FIELDS if params.get(name) is None]
    if missing:
        raise ModelLoadError(f"{source}: {key} of type llama3 is missing {missing[0]!r}")
    scaling = RopeScaling(*(f.positive_float(name, where=where) for name in LLAMA3_FIELDS[:3]),
                          original_max_position_embeddings=f.get(LLAMA3_FIELDS[3], int, where=where))
    if scaling.high_freq_factor <= scaling.low_freq_factor or scaling.original_max_position_embeddings < 1:
        raise ModelLoadError(f"{source}: {key} of type llama3 needs high_freq_factor > low_freq_factor "
                             "and a positive original_max_position_embeddings")
    return theta, scaling


def _yarn(params: dict, f: ConfigFields, key: str, source: str) -> YarnRopeScaling:
    """YarnRopeScaling from a rope dict, its attention factor as transformers infers it."""
    where = f"{key}."
    for name in ("factor", "original_max_position_embeddings"):
        if params.get(name) is None:
            raise ModelLoadError(f"{source}: {key} of type yarn is missing {name!r}")
    factor = f.positive_float("factor", where=where)
    mscale, mscale_all_dim = (f.positive_float(n, None, where) for n in ("mscale", "mscale_all_dim"))
    attention_factor = f.positive_float("attention_factor", None, where)
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    original = f.get("original_max_position_embeddings", int, where=where)
    if original < 1:
        raise ModelLoadError(f"{source}: {key}.original_max_position_embeddings must be positive, got {original}")
    return YarnRopeScaling(factor, original, attention_factor,
                           beta_fast=f.positive_float("beta_fast", None, where) or 32.0,
                           beta_slow=f.positive_float("beta_slow", None, where) or 1.0,
                           truncate=f.get("truncate", bool, True, where))


def parse_layer_ropes(cfg: dict, source: str, default_full: float, default_sliding: float) -> dict[str, Rope]:
    """{layer type: (theta, scaling)} of a model whose full and sliding layers rotate differently
    (Gemma 3). Mirrors Gemma3TextConfig.convert_rope_params_to_dict: rope_scaling applies to the
    full layers, rope_theta is theirs, rope_local_base_freq the sliding layers'; the defaults are
    the config class's. A value given in both forms must agree."""
    nested = cfg.get("rope_parameters")
    if nested is not None and not isinstance(nested, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object, got {nested!r}")
    nested = nested or {}
    unknown = sorted(set(nested) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"{source}: rope_parameters must be keyed by layer type ({', '.join(LAYER_TYPES)}); "
                             f"field {unknown[0]!r} is not one")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor={cfg['partial_rotary_factor']!r} is not "
                             "supported (RoPE on the whole head only)")
    legacy_scaling = cfg.get("rope_scaling")
    if legacy_scaling is not None and not isinstance(legacy_scaling, dict):
        raise ModelLoadError(f"{source}: field 'rope_scaling' must be an object, got {legacy_scaling!r}")
    fields = ConfigFields(cfg, source)
    legacy = {FULL: (fields.positive_float("rope_theta", None),
                     rope_from_dict(legacy_scaling, "rope_scaling", source)[1] if legacy_scaling else None),
              SLIDING: (fields.positive_float("rope_local_base_freq", None), None)}
    ropes = {}
    for layer_type, default_theta in ((FULL, default_full), (SLIDING, default_sliding)):
        params = nested.get(layer_type)
        if params is not None and not isinstance(params, dict):
            raise ModelLoadError(f"{source}: field 'rope_parameters.{layer_type}' must be an object, got {params!r}")
        theta, scaling = rope_from_dict(params, f"rope_parameters.{layer_type}", source) if params else (None, None)
        old_theta, old_scaling = legacy[layer_type]
        if theta is not None and old_theta is not None and theta != old_theta:
            old_name = "rope_theta" if layer_type == FULL else "rope_local_base_freq"
            raise ModelLoadError(f"{source}: conflicting rope_theta values for {layer_type} layers "
                                 f"(rope_parameters: {theta:g}, {old_name}: {old_theta:g})")
        if params and legacy_scaling and layer_type == FULL and scaling != old_scaling:
            raise ModelLoadError(f"{source}: rope_scaling and rope_parameters.full_attention disagree; remove one")
        ropes[layer_type] = (next((t for t in (theta, old_theta) if t is not None), default_theta),
                             scaling or old_scaling)
    if isinstance(ropes[SLIDING][1], YarnRopeScaling):    # its attention factor would differ by layer
        raise ModelLoadError(f"{source}: yarn RoPE scaling on the sliding layers is not supported")
    return ropes


def parse_layer_types(cfg: dict, source: str, num_layers: int, default: list[str]) -> tuple[str, ...]:
    """config.json's layer_types (one of LAYER_TYPES per layer), or `default` when absent."""
    value = cfg.get("layer_types")
    if value is None:
        return tuple(default)
    if not isinstance(value, list) or len(value) != num_layers or not all(t in LAYER_TYPES for t in value):
        raise ModelLoadError(f"{source}: field 'layer_types' must list {num_layers} layer types "
                             f"({' or '.join(LAYER_TYPES)}), got {value!r}")
    return tuple(value)
