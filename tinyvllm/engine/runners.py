"""Which runner serves an EngineConfig's device, and starting one over a model's weights: the
one module that names the backends (reference/numpy_runner.py's NumpyRunner for device="cpu",
parallel/numpy_ranks.py's ShardedNumpyRunner with tensor_parallel_size > 1, gpu/cuda_runner.py's
CudaRunner for "cuda"). Their base class (engine/model_runner.py) imports none of them, and each
backend is imported only when asked for, so engine start-up and the tensor-parallel ranks
(parallel/) share these without an import cycle. A backend that cannot start (no PyCUDA, no GPU,
a failed CUDA start-up) is one GPUUnavailableError line naming --device cpu, never a traceback.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.checkpoint.loading import cuda_refuses
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.errors import GPUUnavailableError, ModelLoadError, TinyVLLMError
from tinyvllm.quant.weight_kinds import cuda_unsupported


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
