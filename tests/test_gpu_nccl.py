"""NCCL over ctypes (tinyvllm/gpu/nccl.py): where the library is looked for, NVLS kept off, the
unique id's bytes; on a GPU (marker gpu) a one-rank communicator's all-reduce in fp32 and bf16
into poisoned outputs, eager and captured into a CUDA graph; the max over uint64 keys, the
all-gather and the grouped broadcasts tensor parallelism's LM head uses; and NCCL's own error
message. (Over several GPUs: tests/test_tensor_parallel_multi_gpu.py.)"""
from __future__ import annotations

import os
import types

import ml_dtypes
import numpy as np
import pytest

from tinyvllm.errors import GPUUnavailableError
from tinyvllm.gpu import nccl
from tinyvllm.gpu.nccl import NcclCommunicator, NcclError, NcclUniqueId, library_paths, load_libnccl, new_unique_id

NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def test_loading_nccl_turns_nvlink_multicast_off_first(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    try:
        load_libnccl()
    except GPUUnavailableError as e:          # no NCCL on this machine: the error says what to install
        assert "pip install nvidia-nccl-cu13" in str(e) and "\n" not in str(e)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_the_nvidia_nccl_wheel_is_looked_in_before_the_system_loader(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").write_bytes(b"")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(nccl.importlib.util, "find_spec", lambda name: spec if name == "nvidia.nccl" else None)
    assert library_paths() == [str(tmp_path / "lib" / "libnccl.so.2"), "libnccl.so.2"]

    def missing(name):
        raise ModuleNotFoundError(name)
    monkeypatch.setattr(nccl.importlib.util, "find_spec", missing)
    assert library_paths() == ["libnccl.so.2"]


def test_unique_id_keeps_every_byte(rng):
    raw = bytes(rng.integers(0, 256, 128, dtype=np.uint8))
    raw = b"\0" + raw[1:64] + b"\0" + raw[65:]                   # NULs inside are bytes like any other
    assert NcclUniqueId.of(raw).raw() == raw
    with pytest.raises(ValueError, match="128 bytes, got 127"):
        NcclUniqueId.of(raw[:127])


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank communicator on GPU 0, its context current for the module."""
    from tinyvllm.gpu.driver import CudaDevice
    try:
        load_libnccl()
    except GPUUnavailableError as e:
        pytest.skip(str(e))
    device = CudaDevice()
    with device.active():
        comm = NcclCommunicator(new_unique_id(), 1, 0)
        yield comm
        comm.close()


def _upload(x: np.ndarray):
    import pycuda.driver as drv
    buf = drv.mem_alloc(x.nbytes)
    drv.memcpy_htod(buf, np.ascontiguousarray(x))
    return buf


def _download(buf, n: int, dtype) -> np.ndarray:
    import pycuda.driver as drv
    out = np.empty(n, dtype)
    drv.memcpy_dtoh(out, buf)
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_all_reduce_is_a_copy_into_poisoned_outputs(one_rank, rng, dtype):
    import pycuda.driver as drv
    n, np_dtype = 4099, NUMPY_DTYPES[dtype]
    x = rng.standard_normal(n).astype(np_dtype)
    send, recv = _upload(x), _upload(np.full(n, np.nan, np_dtype))
    stream = drv.Stream()
    one_rank.all_reduce(int(send), int(recv), n, dtype, stream.handle)
    stream.synchronize()
    np.testing.assert_array_equal(_bits(_download(recv, n, np_dtype)), _bits(x))
    one_rank.all_reduce(int(send), int(send), n, dtype, stream.handle)          # in place
    stream.synchronize()
    np.testing.assert_array_equal(_bits(_download(send, n, np_dtype)), _bits(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_is_captured_into_a_cuda_graph(one_rank, rng, dtype):
    """Captured, not run; each replay reads the send buffer as it is then."""
    import pycuda.driver as drv

    from tinyvllm.gpu.graphs import CudaGraph
    n, np_dtype = 1000, NUMPY_DTYPES[dtype]
    poison = np.full(n, np.nan, np_dtype)
    send, recv = _upload(np.zeros(n, np_dtype)), _upload(poison)
    stream = drv.Stream()
    with CudaGraph.capture(stream) as graph:
        one_rank.all_reduce(int(send), int(recv), n, dtype, stream.handle)
    stream.synchronize()
    assert np.isnan(_download(recv, n, np_dtype).astype(np.float32)).all()     # capture ran nothing
    with CudaGraph.capture(stream) as in_place:                              # as the model sums `hidden`
        one_rank.all_reduce(int(send), int(send), n, dtype, stream.handle)
    try:
        for _ in range(2):
            x = rng.standard_normal(n).astype(np_dtype)
            drv.memcpy_htod(send, x)
            drv.memcpy_htod(recv, poison)
            graph.launch(stream)
            in_place.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(_bits(_download(recv, n, np_dtype)), _bits(x))
            np.testing.assert_array_equal(_bits(_download(send, n, np_dtype)), _bits(x))
    finally:
        graph.close()
        in_place.close()


@pytest.mark.gpu
def test_nccl_errors_carry_nccls_message(one_rank):
    with pytest.raises(NcclError, match=r"ncclCommInitRank\(rank 1 of 1\) failed: .+ \(ncclResult \d+\)"):
        NcclCommunicator(new_unique_id(), 1, 1)
    with pytest.raises(ValueError, match="dtype must be one of uint64, float32, bfloat16"):
        one_rank.all_reduce(0, 0, 1, "float16", 0)
    with pytest.raises(ValueError, match="op must be one of sum, max"):
        one_rank.all_reduce(0, 0, 1, "float32", 0, op="min")
    with pytest.raises(ValueError, match="one part per rank"):
        one_rank.broadcast_each([(0, 1), (0, 1)], "float32", 0)
    assert nccl.nccl_version() >= 21800          # bf16 all-reduces need NCCL 2.10; the cu13 wheel is 2.27+


@pytest.mark.gpu
def test_one_rank_max_gather_and_broadcasts_into_poisoned_outputs(one_rank, rng):
    """On one rank: the uint64 max all-reduce (the greedy argmax keys) and the all-gather are
    copies into poisoned outputs; broadcast_each leaves its one part as it is; all three captured
    into a CUDA graph replay the same."""
    import pycuda.driver as drv

    from tinyvllm.gpu.graphs import CudaGraph
    n = 777
    keys = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    logits = rng.standard_normal(n).astype(np.float32)
    send_keys, recv_keys = _upload(keys), _upload(np.zeros(n, np.uint64))
    send, gathered, part = _upload(logits), _upload(np.full(n, np.nan, np.float32)), _upload(logits)
    stream = drv.Stream()

    def collectives():
        one_rank.all_reduce(int(send_keys), int(recv_keys), n, "uint64", stream.handle, op="max")
        one_rank.all_gather(int(send), int(gathered), n, "float32", stream.handle)
        one_rank.broadcast_each([(int(part), n)], "float32", stream.handle)

    collectives()
    stream.synchronize()
    np.testing.assert_array_equal(_download(recv_keys, n, np.uint64), keys)
    np.testing.assert_array_equal(_bits(_download(gathered, n, np.float32)), _bits(logits))
    np.testing.assert_array_equal(_bits(_download(part, n, np.float32)), _bits(logits))
    drv.memcpy_htod(recv_keys, np.zeros(n, np.uint64))
    drv.memcpy_htod(gathered, np.full(n, np.nan, np.float32))
    with CudaGraph.capture(stream) as graph:
        collectives()
    try:
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(_download(recv_keys, n, np.uint64), keys)
        np.testing.assert_array_equal(_bits(_download(gathered, n, np.float32)), _bits(logits))
    finally:
        graph.close()
