"""Configuration: what the model is (ModelConfig, read from HF config.json) and how the engine
runs it (EngineConfig). Both are frozen: nothing changes them after start-up.

config.json comes in two forms. transformers 4.x writes RoPE as top-level `rope_theta` plus an
optional `rope_scaling` dict and the dtype as `torch_dtype`; transformers 5.x writes one
`rope_parameters` dict ({"rope_type", "rope_theta", and the scaling fields}) and `dtype`. Both
are read; a field in both forms must agree. Anything we would have to ignore to load the model
(an unimplemented rope type, partial rotary, biases, quantized weights) is a ModelLoadError
naming the field, never a silent default."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.errors import ModelLoadError

# Architectures whose checkpoints have exactly the Llama tensor layout and maths.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# transformers' LlamaConfig default (RotaryEmbeddingConfigMixin.default_theta) when a config
# names no theta in either form; followed so that such a directory loads as it does there.
DEFAULT_ROPE_THETA = 10000.0
DTYPES = ("bfloat16", "float16", "float32")      # what weights.py reads (all served as bf16)
# rope_parameters / rope_scaling keys each rope type may carry ("type" is the pre-4.45 name
# of "rope_type"); any other key is a feature we do not implement.
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"}}
ROPE_KEYS["llama3"] = ROPE_KEYS["default"] | set(LLAMA3_FIELDS)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling ("rope_type": "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None       # informational: tokenizer.json decides what encode() adds
    eos_token_ids: tuple[int, ...]
    dtype: str = "bfloat16"        # the checkpoint's dtype as config.json states it

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + lm_head

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for one token across all layers."""
        return self.num_hidden_layers * 2 * self.kv_size * 2

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: must be a JSON object, got a {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        known = isinstance(archs, list) and any(a in SUPPORTED_ARCHITECTURES for a in archs)
        if not known and model_type != "llama":
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or model_type!r}; "
                f"tinyvllm serves Llama-architecture models ({', '.join(SUPPORTED_ARCHITECTURES)})")
        f = _Fields(cfg, source)
        heads, hidden = f.positive_int("num_attention_heads"), f.positive_int("hidden_size")
        kv_heads = f.positive_int("num_key_value_heads", default=heads)
        if "head_dim" not in cfg or cfg["head_dim"] is None:
            if hidden % heads:
                raise ModelLoadError(f"{source}: hidden_size={hidden} is not a multiple of "
                                     f"num_attention_heads={heads} and no head_dim is given")
        head_dim = f.positive_int("head_dim", default=hidden // heads)
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim={head_dim} is odd; RoPE rotates pairs of dimensions")
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={kv_heads}")
        # transformers' ACT2FN maps "swish" to the same SiLU
        if f.get("hidden_act", str, "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        for name in ("attention_bias", "mlp_bias"):
            if f.get(name, bool, False):
                raise ModelLoadError(f"{source}: {name}=true is not supported (no bias tensors)")
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"]
            method = method.get("quant_method", "?") if isinstance(method, dict) else method
            raise ModelLoadError(f"{source}: quantized checkpoints (quantization_config: {method!r}) "
                                 "are not supported; use bf16/fp16/fp32 weights")
        # pretraining_tp > 1 made old transformers split each matmul into slices and sum them:
        # the same maths, so any positive value is served as it is.
        f.positive_int("pretraining_tp", default=1)
        rope_theta, rope_scaling = _parse_rope(cfg, source)
        return cls(
            vocab_size=f.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.positive_int("intermediate_size"),
            num_hidden_layers=f.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.positive_float("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=f.positive_int("max_position_embeddings"),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, False),   # LlamaConfig's default
            bos_token_id=f.token_ids("bos_token_id", allow_list=False),
            eos_token_ids=f.token_ids("eos_token_id", allow_list=True),
            dtype=_parse_dtype(cfg, source),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path}: invalid JSON ({e})") from None
        return cls.from_dict(cfg, str(cfg_path))


KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class _Fields:
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


def _parse_dtype(cfg: dict, source: str) -> str:
    given = {k: cfg[k] for k in ("dtype", "torch_dtype") if cfg.get(k) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise ModelLoadError(f"{source}: dtype={given['dtype']!r} and torch_dtype="
                             f"{given['torch_dtype']!r} disagree")
    dtype = next(iter(given.values()), "bfloat16")
    if dtype not in DTYPES:
        raise ModelLoadError(f"{source}: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return dtype


def _parse_rope(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling or None) from either form. transformers 5 lets rope_scaling
    override rope_parameters; here two forms present at once must say the same thing."""
    forms = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ModelLoadError(f"{source}: field {key!r} must be an object, got {value!r}")
        if value:
            forms[key] = _rope_from_dict(value, key, source)
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor={cfg['partial_rotary_factor']!r} is not "
                             "supported (RoPE on the whole head only)")
    top_theta = _Fields(cfg, source).positive_float("rope_theta", None)
    if len(forms) == 2 and forms["rope_parameters"][1] != forms["rope_scaling"][1]:
        raise ModelLoadError(f"{source}: rope_scaling and rope_parameters disagree; remove one")
    thetas = {k: theta for k, (theta, _) in forms.items() if theta is not None}
    if top_theta is not None:
        thetas["rope_theta"] = top_theta
    if len(set(thetas.values())) > 1:
        raise ModelLoadError(f"{source}: conflicting rope_theta values "
                             f"({', '.join(f'{k}: {v:g}' for k, v in thetas.items())})")
    theta = next(iter(thetas.values()), DEFAULT_ROPE_THETA)
    scaling = next((s for _, s in forms.values()), None)
    return theta, scaling


def _rope_from_dict(params: dict, key: str, source: str) -> tuple[float | None, RopeScaling | None]:
    kinds = {params[k] for k in ("rope_type", "type") if isinstance(params.get(k), str)}
    if any(params.get(k) is not None and not isinstance(params[k], str) for k in ("rope_type", "type")):
        raise ModelLoadError(f"{source}: {key}.rope_type must be a string, got {params.get('rope_type')!r}")
    if len(kinds) > 1:
        raise ModelLoadError(f"{source}: {key} has both rope_type and type, and they differ ({kinds})")
    kind = next(iter(kinds), "default")
    if kind not in ROPE_KEYS:
        raise ModelLoadError(f"{source}: unsupported rope type {kind!r} in {key} "
                             f"(tinyvllm implements: {', '.join(ROPE_KEYS)})")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise ModelLoadError(f"{source}: {key} field {unknown[0]!r} is not supported for rope type {kind!r}")
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: {key}.partial_rotary_factor={params['partial_rotary_factor']!r} "
                             "is not supported (RoPE on the whole head only)")
    f = _Fields(params, source)
    where = f"{key}."
    theta = f.positive_float("rope_theta", None, where)
    if kind == "default":
        return theta, None
    missing = [name for name in LLAMA3_FIELDS if params.get(name) is None]
    if missing:
        raise ModelLoadError(f"{source}: {key} of type llama3 is missing {missing[0]!r}")
    scaling = RopeScaling(*(f.positive_float(name, where=where) for name in LLAMA3_FIELDS[:3]),
                          original_max_position_embeddings=f.get(LLAMA3_FIELDS[3], int, where=where))
    if scaling.high_freq_factor <= scaling.low_freq_factor or scaling.original_max_position_embeddings < 1:
        raise ModelLoadError(f"{source}: {key} of type llama3 needs high_freq_factor > low_freq_factor "
                             "and a positive original_max_position_embeddings")
    return theta, scaling


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Budgets are per scheduler step."""
    max_num_seqs: int = 256              # sequences in one decode batch
    max_num_batched_tokens: int = 8192   # prompt tokens in one prefill batch
    max_model_len: int | None = None     # context limit; None = the model's max_position_embeddings
    block_size: int = 16                 # tokens per KV-cache block
    gpu_memory_utilization: float = 0.90 # fraction of free GPU memory the KV cache may take ...
    kv_cache_gb: float | None = None     # ... unless an explicit size is given
    num_kv_blocks: int | None = None     # exact block count (tests, numpy backend)
    enforce_eager: bool = False          # no CUDA graphs
    scheduling: str = "continuous"       # or "static": a fixed batch runs to completion
    device: str = "cuda"                 # or "cpu": the numpy reference backend
    seed: int = 0

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")

    def context_limit(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)

    def max_blocks_per_seq(self, model: ModelConfig) -> int:
        return math.ceil(self.context_limit(model) / self.block_size)
