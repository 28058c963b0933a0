"""What LLMEngine(...) does before its first request: the engine config from its options, the
backend for EngineConfig.device, the model directory loaded into it, and the engine config
fitted to the KV cache it got.

This is the one module that names the backends: reference/numpy_runner.py's NumpyRunner for
device="cpu" (parallel/numpy_ranks.py's ShardedNumpyRunner with tensor_parallel_size > 1),
gpu/cuda_runner.py's CudaRunner for "cuda". Their base class
(engine/model_runner.py) imports neither, so each imports it with no cycle. A backend that cannot
start (no PyCUDA, no GPU, a failed CUDA start-up) is one GPUUnavailableError line naming
--device cpu, never a traceback.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.loading import cuda_refuses, read_weights, resolve_checkpoint
from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.limits import fit_context_to_cache
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.errors import ConfigError, GPUUnavailableError, ModelLoadError, TinyVLLMError
from tinyvllm.parallel.sharding import check_engine_split
from tinyvllm.parallel.workers import RankProcesses, uses_rank_processes
from tinyvllm.quant.weight_kinds import cuda_unsupported


def make_engine_config(engine_config: EngineConfig | None, options: dict) -> EngineConfig:
    """engine_config (None: the defaults) with keyword options applied; an unknown or invalid
    option is one TinyVLLMError naming it."""
    try:
        if engine_config is None:
            return EngineConfig(**options)
        return dataclasses.replace(engine_config, **options)
    except TypeError as e:           # an unknown keyword
        known = ", ".join(f.name for f in dataclasses.fields(EngineConfig))
        raise TinyVLLMError(f"unknown engine option ({e}); known options: {known}") from None
    except ValueError as e:          # EngineConfig's own range checks
        raise ConfigError(f"invalid engine option: {e}") from None


def runner_class(engine_config: EngineConfig) -> type[ModelRunner]:
    """The runner class of engine_config's device; a backend that cannot be loaded is a one-line
    error (asked before the default model's first conversion, which takes seconds)."""
    if engine_config.device == "cpu" and (engine_config.tensor_parallel_size or 1) > 1:
        from tinyvllm.parallel.numpy_ranks import ShardedNumpyRunner
        return ShardedNumpyRunner
    if engine_config.device == "cpu":
        from tinyvllm.reference.numpy_runner import NumpyRunner
        return NumpyRunner
    try:
        from tinyvllm.gpu.cuda_runner import CudaRunner
    except ImportError as e:
        if (e.name or "").startswith("pycuda"):
            raise GPUUnavailableError("PyCUDA is not installed: use --device cpu, or install the "
                                      "gpu extra (pip install -e '.[gpu]')") from None
        raise GPUUnavailableError(f"the CUDA backend cannot be loaded ({e}); use --device cpu") from None
    return CudaRunner


def check_cuda_support(config: ModelConfig) -> None:
    """Before the GPU starts: one ModelLoadError line when the CUDA kernels cannot compute this
    model (every family's differences from Llama are computed, gpu/model.py; the attention kernels
    are instantiated for the head shapes of the .cu files' lists)."""
    from tinyvllm.gpu.ops.attention import attention_kernels_missing
    missing = attention_kernels_missing(config.head_dim, config.num_attention_heads, config.num_key_value_heads)
    if missing:
        raise ModelLoadError(f"the CUDA backend has {missing}: serve this model with --device cpu")


def make_runner(config: ModelConfig, weights: dict[str, np.ndarray], engine_config: EngineConfig) -> ModelRunner:
    """A started runner of engine_config's device holding `weights`."""
    if engine_config.device == "cuda":
        unsupported = cuda_unsupported(weights)
        if unsupported:
            raise ModelLoadError(cuda_refuses(unsupported))
        check_cuda_support(config)
    try:
        return runner_class(engine_config)(config, weights, engine_config)
    except TinyVLLMError:
        raise
    except Exception as e:  # noqa: BLE001 — driver errors come as pycuda's own exception types
        if type(e).__module__.startswith("pycuda"):
            raise GPUUnavailableError(f"CUDA start-up failed ({e}); use --device cpu") from None
        raise


@dataclass(frozen=True)
class LoadedModel:
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    engine_config: EngineConfig        # with its context fitted to the runner's KV cache


def load_model(model: str | Path | None, engine_config: EngineConfig, runner: ModelRunner | None,
               chat_template: str | Path | None) -> LoadedModel:
    """The model directory (None: the default model, checkpoint/default_model.py; a GGUF file: its
    blocks kept, checkpoint/gguf_blocks.py), its config and tokenizer, and a runner holding its
    weights, quantized as the checkpoint is or as engine_config.quantization asks (`runner`, when
    given, is used as it is: tests and benchmarks drive the real engine with a fake model this
    way). With trace_steps the runner is wrapped in tinyvllm/trace.py's TracingRunner."""
    if runner is None and model is None:
        runner_class(engine_config)        # a backend that cannot load is said before the default model's conversion
    model_dir, gguf_file = resolve_checkpoint(model, engine_config)
    model_config = ModelConfig.from_pretrained(model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir, model_config, chat_template)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ModelLoadError(
            f"{model_dir}: tokenizer.json has {tokenizer.vocab_size} tokens but config.json's "
            f"vocab_size is {model_config.vocab_size}: the model has no embedding for the rest")
    if runner is None:
        check_engine_split(model_config, engine_config)       # before the weights load
        if engine_config.device == "cuda":
            check_cuda_support(model_config)       # before the weights load
        if uses_rank_processes(engine_config):     # each rank reads its own shards
            runner = RankProcesses(model_config, engine_config, model_dir, gguf_file)
        else:
            runner = make_runner(model_config, read_weights(model_dir, gguf_file, model_config, engine_config),
                                 engine_config)
    try:
        engine_config = fit_context_to_cache(engine_config, model_config, runner.num_kv_blocks)
    except TinyVLLMError:
        runner.close()                     # give the device memory back before the error leaves
        raise
    if engine_config.trace_steps:          # eager, printed steps first
        from tinyvllm.trace import TracingRunner
        runner = TracingRunner(runner, model_config, engine_config)
    return LoadedModel(model_dir, model_config, tokenizer, runner, engine_config)
