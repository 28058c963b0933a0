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
        if "gpu" in item.keywords:
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
def kernel_library():
    """GPU tests: the device's primary CUDA context pushed for the module, and every cuda/*.cu
    kernel compiled (PyCUDA caches the cubins)."""
    import pycuda.driver as drv
    from tinyvllm.gpu.kernels import KernelLibrary
    drv.init()
    ctx = drv.Device(0).retain_primary_context()
    ctx.push()
    try:
        yield KernelLibrary()
        drv.Context.synchronize()
    finally:
        ctx.pop()


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed so a failure can be reproduced."""
    import numpy as np
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
