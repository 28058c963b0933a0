"""What LLMEngine(...) does before its first request: the engine config from its options, the
backend for EngineConfig.device, the model directory loaded into it, and the engine config
fitted to the KV cache it got.

The runner itself comes from engine/runners.py (which backend, started over the weights), or
for a split engine from parallel/workers.py's RankProcesses.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.checkpoint.loading import read_weights, resolve_checkpoint
from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.limits import fit_context_to_cache
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.runners import check_cuda_support, make_runner, runner_class
from tinyvllm.errors import ConfigError, ModelLoadError, TinyVLLMError
from tinyvllm.parallel.sharding import check_engine_split
from tinyvllm.parallel.workers import RankProcesses, uses_rank_processes


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
