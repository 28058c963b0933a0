"""Configuration: what the model is (ModelConfig, read from HF config.json) and how the engine
runs it (EngineConfig). Both are frozen: nothing changes them after start-up."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.errors import ModelLoadError

# Architectures whose checkpoints have exactly the Llama tensor layout and maths.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


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
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "bfloat16"

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
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and model_type != "llama":
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or model_type!r}; "
                f"tinyvllm serves Llama-architecture models ({', '.join(SUPPORTED_ARCHITECTURES)})")

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={kv_heads}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelLoadError(f"{source}: attention_bias/mlp_bias are not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("rms_norm_eps")),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=_parse_rope_scaling(cfg.get("rope_scaling"), source),
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype", "bfloat16")),
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


def _parse_rope_scaling(rs: dict | None, source: str) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3, none)")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: rope_scaling of type llama3 is missing {e.args[0]!r}") from None


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[D/2] float32 rotation frequencies, with Llama 3's scaling when the config asks for it.

    Llama 3 stretches the context by slowing the low frequencies only: a pair whose wavelength
    is longer than the original context / low_freq_factor is divided by `factor`, a pair whose
    wavelength is shorter than original / high_freq_factor is kept, and the band between them
    blends the two linearly in (original context / wavelength)."""
    d = config.head_dim
    freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = config.rope_scaling
    if rs is None:
        return freq.astype(np.float32)
    original = rs.original_max_position_embeddings
    wavelen = 2 * math.pi / freq
    # 0 at the low-frequency edge of the band, 1 at the high-frequency edge
    blend = (original / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blend = np.clip(blend, 0.0, 1.0)
    scaled = (1 - blend) * freq / rs.factor + blend * freq
    scaled = np.where(wavelen > original / rs.low_freq_factor, freq / rs.factor, scaled)
    scaled = np.where(wavelen < original / rs.high_freq_factor, freq, scaled)
    return scaled.astype(np.float32)



INT32_MAX = 2**31 - 1              # token ids, positions, slots and counts are int32 on the device
AUTO = "auto"                       # max_model_len="auto": the model's, lowered to what the KV cache holds


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Budgets are per scheduler step."""
    max_num_seqs: int = 256              # sequences in one decode batch
    max_num_batched_tokens: int = 8192   # prompt tokens in one prefill batch
    max_model_len: int | str | None = None   # context limit; None = the model's max_position_embeddings;
                                         # "auto" = that, lowered (with a warning) to what the KV cache holds
    block_size: int = 16                 # tokens per KV-cache block
    gpu_memory_utilization: float = 0.90 # fraction of free GPU memory the KV cache may take ...
    kv_cache_gb: float | None = None     # ... unless an explicit size is given
    num_kv_blocks: int | None = None     # exact block count (tests, numpy backend)
    enforce_eager: bool = False          # no CUDA graphs
    scheduling: str = "continuous"       # or "static": a fixed batch runs to completion
    device: str = "cuda"                 # or "cpu": the numpy reference backend
    seed: int = 0
    trace_steps: int = 0                 # print every kernel / cuBLAS call of the first N steps (trace.py)

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs, 1, INT32_MAX)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, INT32_MAX)
        if self.max_model_len not in (None, AUTO):
            _check_int("max_model_len", self.max_model_len, 1, INT32_MAX, "or 'auto'")
        _check_int("block_size", self.block_size, 1, 1 << 16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_number("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gb is not None:
            _check_number("kv_cache_gb", self.kv_cache_gb)
            if not self.kv_cache_gb > 0:
                raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.num_kv_blocks is not None:   # every slot (block * block_size + offset) is an int32
            _check_int("num_kv_blocks", self.num_kv_blocks, 1, INT32_MAX // self.block_size)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        _check_int("seed", self.seed, 0, 2**64 - 1)
        _check_int("trace_steps", self.trace_steps, 0, INT32_MAX)

    def context_limit(self, model: ModelConfig) -> int:
        asked = self.max_model_len if isinstance(self.max_model_len, int) else None
        return min(asked or model.max_position_embeddings, model.max_position_embeddings)

    def max_blocks_per_seq(self, model: ModelConfig) -> int:
        return math.ceil(self.context_limit(model) / self.block_size)


def _check_int(name: str, value, lo: int, hi: int, also: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{' ' + also if also else ''}, "
                         f"got {value!r}")


def _check_number(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
