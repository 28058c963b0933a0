"""Configuration: what the model is (ModelConfig, read from HF config.json) and how the engine
runs it (EngineConfig). Both are frozen: nothing changes them after start-up.

config.json is read in both its transformers 4 and 5 forms (tinyvllm/hf_config.py), for every
family of tinyvllm/model_family.py. Anything we would have to ignore to load the model (an
unimplemented rope type, partial rotary, soft-capping, a quantization_config field
tinyvllm/quant/quant_config.py cannot honour) and any malformed value is a ModelLoadError naming
the field, never a silent default."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.errors import ModelLoadError, TinyVLLMError
from tinyvllm.hf_config import FULL, SLIDING, ConfigFields, LinearRopeScaling, RopeScaling, YarnRopeScaling, parse_dtype
from tinyvllm.model_family import (
    FAMILIES,
    HEAD_DIM_DEFAULT,
    TIED_DEFAULT,
    family_fields,
    family_of,
    language_model_config,
)
from tinyvllm.quant.quant_config import QuantConfig, parse_quantization_config

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeScaling", "LinearRopeScaling", "YarnRopeScaling",
           "EngineConfig"]

SUPPORTED_ARCHITECTURES = tuple(FAMILIES.values())


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
    rope_scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None     # of the full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None       # informational: tokenizer.json decides what encode() adds
    eos_token_ids: tuple[int, ...]
    dtype: str = "bfloat16"        # the checkpoint's dtype as config.json states it
    # What a family changes from Llama (tinyvllm/model_family.py); the defaults are Llama's.
    family: str = "llama"          # config.json's model_type
    qkv_bias: bool = False         # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False          # RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)
    norm_weight_offset: float = 0.0     # RMSNorm multiplies by (offset + w): 1 on Gemma 3
    sandwich_norms: bool = False   # norms on the attention output and before/after the MLP (Gemma 3)
    hidden_act: str = "silu"       # the gate's activation: "silu", or "gelu_tanh" (Gemma 3's GeGLU)
    embedding_scale: float | None = None    # embeddings times this (Gemma 3: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None   # scores times this^-1/2, not head_dim^-1/2 (Gemma 3)
    sliding_window: int | None = None     # a sliding layer attends to its last `sliding_window` positions
    layer_types: tuple[str, ...] = ()     # per layer "full_attention" / "sliding_attention"; () = all full
    sliding_rope_theta: float | None = None   # sliding layers' own RoPE (Gemma 3); None: the full layers'
    sliding_rope_scaling: RopeScaling | LinearRopeScaling | None = None
    nope_layers: tuple[int, ...] = ()     # layers whose attention applies no RoPE (SmolLM3: every 4th)
    quantization: QuantConfig | None = None   # config.json's quantization_config (FP8 weights)

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
        per_layer += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        per_layer += 2 * h * self.sandwich_norms
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + L * per_layer + h + lm_head

    @property
    def decode_parameters(self) -> int:
        """The parameters a decode step reads: all but an untied embedding table, of which it
        gathers only its tokens' rows (a tied one is the LM head, read whole)."""
        return self.num_parameters - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def max_context(self) -> int:
        """The longest context the model serves: max_position_embeddings, or with YaRN the original
        context times its factor (the length it was stretched to; vLLM derives it so)."""
        if isinstance(self.rope_scaling, YarnRopeScaling):
            return int(self.rope_scaling.original_max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: head_dim^-1/2, or Gemma 3's own scalar's; with
        YaRN, times its attention factor squared (q and k each carry one factor in transformers)."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        yarn = self.rope_scaling if isinstance(self.rope_scaling, YarnRopeScaling) else None
        return scale * yarn.attention_factor ** 2 if yarn else scale

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def layer_window(self, layer: int) -> int | None:
        """How many of the latest positions the layer attends to (its own included); None: all."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def differences_from_llama(self) -> list[str]:
        """What this model computes that the Llama forward pass does not (empty for Llama, and
        for Mistral without a sliding window)."""
        checks = [(self.qkv_bias, "q/k/v biases"), (self.qk_norm, "q/k norms"),
                  (self.norm_weight_offset, "RMSNorm x*(1+w)"),
                  (self.sandwich_norms, "norms around attention and MLP outputs"),
                  (self.hidden_act != "silu", f"{self.hidden_act} activation"),
                  (self.embedding_scale is not None, "scaled embeddings"),
                  (self.query_pre_attn_scalar is not None, "query_pre_attn_scalar"),
                  (self.sliding_window is not None, "sliding-window attention"),
                  (bool(self.nope_layers), "layers without RoPE"),
                  (self.sliding_rope_theta is not None, "a RoPE per layer type")]
        return [what for present, what in checks if present]

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for one token across all layers."""
        return self.num_hidden_layers * 2 * self.kv_size * 2

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: must be a JSON object, got a {type(cfg).__name__}")
        cfg = language_model_config(cfg, source)
        family = family_of(cfg, source)
        f = ConfigFields(cfg, source)
        heads, hidden = f.positive_int("num_attention_heads"), f.positive_int("hidden_size")
        kv_heads = f.positive_int("num_key_value_heads", default=heads)
        if cfg.get("head_dim") is None and family not in HEAD_DIM_DEFAULT and hidden % heads:
            raise ModelLoadError(f"{source}: hidden_size={hidden} is not a multiple of "
                                 f"num_attention_heads={heads} and no head_dim is given")
        head_dim = f.positive_int("head_dim", default=HEAD_DIM_DEFAULT.get(family, hidden // heads))
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim={head_dim} is odd; RoPE rotates pairs of dimensions")
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={kv_heads}")
        # pretraining_tp > 1 made old transformers split each matmul into slices and sum them:
        # the same maths, so any positive value is served as it is.
        f.positive_int("pretraining_tp", default=1)
        layers = f.positive_int("num_hidden_layers")
        return cls(
            vocab_size=f.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.positive_int("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.positive_float("rms_norm_eps"),
            max_position_embeddings=f.positive_int("max_position_embeddings"),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, TIED_DEFAULT.get(family, False)),
            bos_token_id=f.token_ids("bos_token_id", allow_list=False),
            eos_token_ids=f.token_ids("eos_token_id", allow_list=True),
            dtype=parse_dtype(cfg, source),
            quantization=parse_quantization_config(cfg, source),
            **family_fields(family, cfg, source, layers, hidden),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
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


INT32_MAX = 2**31 - 1              # token ids, positions, slots and counts are int32 on the device
AUTO = "auto"                       # max_model_len="auto": the model's, lowered to what the KV cache holds


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Budgets are per scheduler step."""
    max_num_seqs: int = 256              # sequences in one step
    max_num_batched_tokens: int = 8192   # tokens in one step: a decode row's 1 + prompt chunks (scheduler.py)
    max_model_len: int | str | None = None   # context limit; None = the model's max_position_embeddings;
                                         # "auto" = that, lowered (with a warning) to what the KV cache holds
    block_size: int = 16                 # tokens per KV-cache block
    gpu_memory_utilization: float = 0.90 # fraction of free GPU memory the KV cache may take ...
    kv_cache_gb: float | None = None     # ... unless an explicit size is given
    num_kv_blocks: int | None = None     # exact block count (tests, numpy backend)
    enforce_eager: bool = False          # no CUDA graphs
    enable_prefix_caching: bool = True   # reuse the KV blocks of prompt prefixes computed before
    scheduling: str = "continuous"       # or "static": a fixed batch runs to completion
    device: str = "cuda"                 # or "cpu": the numpy reference backend
    seed: int = 0
    trace_steps: int = 0                 # print every kernel / cuBLAS call of the first N steps (trace.py)
    async_scheduling: bool | None = None # launch each decode step before reading the last one back
                                         # (engine/llm_engine.py); None: where the runner overlaps
                                         # steps (cuda yes, cpu no)
    generation_config: str = "auto"      # sampling defaults: "auto" (the model's generation_config.json),
                                         # "vllm" (none: SamplingParams()), or a directory holding one
    fused_decode: bool = True            # cuda: decode steps of <= 8 sequences run the fused five-launch
                                         # layer (gpu/model.py); False: the nine-launch layer the guide follows
    pdl: bool = True                     # cuda: kernels launch with programmatic dependent launch (each may
                                         # start while the one before ends); False: one after the other
    quantization: str | None = None      # "fp8": a bf16 checkpoint's layer linears quantized at load
                                         # (e4m3, a scale per output row); None: as the checkpoint is
    tensor_parallel_size: int | None = None   # ranks each layer is split over (tinyvllm/parallel/); cuda:
                                         # one process per rank over NCCL, 1 included; None: in-process

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
        for name in ("enforce_eager", "fused_decode", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        _check_int("seed", self.seed, 0, 2**64 - 1)
        if self.tensor_parallel_size is not None:
            _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1 << 16)
        _check_int("trace_steps", self.trace_steps, 0, INT32_MAX)
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise ValueError(f"async_scheduling must be true, false or None, got {self.async_scheduling!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory, "
                             f"got {self.generation_config!r}")

    def context_limit(self, model: ModelConfig) -> int:
        """max_model_len, or the model's own context when none is asked; a longer one than the
        model's is refused (its positions were never trained), as vLLM refuses it."""
        asked = self.max_model_len if isinstance(self.max_model_len, int) else None
        if asked is not None and asked > model.max_context:
            raise TinyVLLMError(f"max_model_len={asked} is longer than the model's context of {model.max_context} "
                                "tokens (max_position_embeddings, or YaRN's original length times its factor)")
        return asked or model.max_context

    def max_blocks_per_seq(self, model: ModelConfig) -> int:
        return math.ceil(self.context_limit(model) / self.block_size)


def _check_int(name: str, value, lo: int, hi: int, also: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{' ' + also if also else ''}, "
                         f"got {value!r}")


def _check_number(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
