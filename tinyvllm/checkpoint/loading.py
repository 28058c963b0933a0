"""Which checkpoint a `--model` names and its weights as the engine holds them: a Hugging Face
directory's safetensors (bf16, an FP8 checkpoint, or bf16 quantized to FP8 at load by
EngineConfig.quantization) or a GGUF file's blocks kept as they are. Shared by the engine's
start-up (engine/startup.py) and `inspect` (model_report.py)."""
from __future__ import annotations

from pathlib import Path

from tinyvllm.checkpoint.default_model import resolve_model_dir
from tinyvllm.checkpoint.gguf_blocks import gguf_model_dir, is_gguf_file, load_gguf_blocks
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.errors import ModelLoadError


def cuda_refuses(kinds: str) -> str:
    """The one line that refuses weights the CUDA kernels do not read (weight_kinds.cuda_unsupported)."""
    return (f"the CUDA backend has no kernels for {kinds} weights (it reads bf16, FP8, and GGUF Q8_0, "
            f"Q4_0, Q4_1, Q4_K and Q6_K blocks, fused groups mixing those formats included): serve the "
            f"model with --device cpu, or in bf16 (convert-gguf for a GGUF file)")


def resolve_checkpoint(model: str | Path | None, engine_config: EngineConfig) -> tuple[Path, Path | None]:
    """(the directory holding config.json and the tokenizer, the GGUF file when `model` is one)."""
    if not is_gguf_file(model):
        return resolve_model_dir(model), None
    if engine_config.quantization:
        raise ModelLoadError(f"{model}: --quantization {engine_config.quantization} quantizes a bf16 "
                             "checkpoint; a GGUF file runs at its own precision (convert-gguf makes a bf16 one)")
    return gguf_model_dir(model), Path(model)


def read_weights(model_dir: Path, gguf_file: Path | None, config: ModelConfig,
                 engine_config: EngineConfig) -> dict:
    """The model's weights, quantized as the checkpoint is or as engine_config.quantization asks."""
    if gguf_file is not None:
        return load_gguf_blocks(gguf_file, config)
    return load_weights(model_dir, config, engine_config.quantization)
