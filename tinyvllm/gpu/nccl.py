"""NCCL through ctypes: a communicator over the ranks of one tensor-parallel group and the
collectives tensor parallelism needs, enqueued on a stream: the all-reduce (sum in bf16 and fp32;
max over uint64 for the greedy argmax keys), the all-gather, and the broadcast, grouped so that a
rank's N broadcasts of its vocabulary slice run as one operation (gpu/tp_layer.py).

The library is PyPI's nvidia-nccl-cu13 wheel (setup.cfg's `tp` extra; torch installs it too):
libnccl.so.2 is looked for in the `nvidia.nccl` package's lib/ folder first, then by the system
loader. Bound: ncclGetUniqueId, ncclCommInitRank, ncclAllReduce, ncclAllGather, ncclBroadcast,
ncclGroupStart, ncclGroupEnd, ncclCommDestroy, ncclGetErrorString, ncclGetVersion; a failing call is one NcclError carrying NCCL's own message.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is put into the process's environment
before the library is loaded, so NCCL reads it when it initialises, in this process and in every
process it starts (tinyvllm/parallel/workers.py's rank processes load NCCL here too).

An all-reduce enqueued on a stream that is capturing is recorded into the graph like a kernel
launch (NCCL supports stream capture), so a decode step's all-reduces replay with its graph. On a
one-rank communicator the all-reduce is a copy (nothing when sending and receiving in place).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from tinyvllm.errors import GPUUnavailableError

NVLS_ENV = "NCCL_NVLS_ENABLE"
UNIQUE_ID_BYTES = 128                    # NCCL_UNIQUE_ID_BYTES (nccl.h)
NCCL_SUCCESS = 0
# ncclDataType_t and ncclRedOp_t (nccl.h)
DTYPE_CODES = {"uint64": 5, "float32": 7, "bfloat16": 9}
DTYPE_BYTES = {"uint64": 8, "float32": 4, "bfloat16": 2}
OP_CODES = {"sum": 0, "max": 2}
NCCL_SUM = OP_CODES["sum"]


class NcclError(RuntimeError):
    """An NCCL call failed: the call and NCCL's message."""


class NcclUniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes made by rank 0 and handed to every rank."""
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]    # raw bytes: NULs included

    @classmethod
    def of(cls, raw: bytes) -> NcclUniqueId:
        if len(raw) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), raw, UNIQUE_ID_BYTES)
        return uid

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES)


def library_paths() -> list[str]:
    """Where libnccl.so.2 may be, in order: the nvidia.nccl wheel's lib/, then the loader's name."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [str(Path(d) / "lib" / "libnccl.so.2") for d in folders if (Path(d) / "lib" / "libnccl.so.2").exists()]
    return found + ["libnccl.so.2"]


_lib: ctypes.CDLL | None = None


def load_libnccl() -> ctypes.CDLL:
    """The NCCL library, loaded once, with NVLS off in the environment first."""
    global _lib
    os.environ[NVLS_ENV] = "0"
    if _lib is not None:
        return _lib
    errors = []
    for path in library_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    else:
        raise GPUUnavailableError("libnccl.so.2 not found (looked in the nvidia-nccl-cu13 wheel and the "
                                  "system loader's paths): pip install nvidia-nccl-cu13")
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [i32]
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(i32)]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i32, NcclUniqueId, i32]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, i32, i32, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, ctypes.c_size_t, i32, vp, vp]
    lib.ncclBroadcast.argtypes = [vp, vp, ctypes.c_size_t, i32, i32, vp, vp]
    lib.ncclGroupStart.argtypes = lib.ncclGroupEnd.argtypes = []
    _lib = lib
    return lib


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result != NCCL_SUCCESS:
        message = lib.ncclGetErrorString(result)
        raise NcclError(f"{call} failed: {message.decode() if message else 'unknown error'} (ncclResult {result})")


def nccl_version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3)."""
    lib = load_libnccl()
    version = ctypes.c_int()
    _check(lib, lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
    return version.value


def new_unique_id() -> bytes:
    """A fresh id for one communicator: made by rank 0, sent to the others (any pipe will do)."""
    lib = load_libnccl()
    uid = NcclUniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return uid.raw()


class NcclCommunicator:
    """Rank `rank` of a `world_size`-rank communicator. Every rank must construct it (NCCL blocks
    until all have), each in its own process with its own GPU's context current."""

    def __init__(self, unique_id: bytes, world_size: int, rank: int):
        uid = NcclUniqueId.of(unique_id)
        self.lib = load_libnccl()
        self.world_size, self.rank = world_size, rank
        self.comm = ctypes.c_void_p()
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank),
               f"ncclCommInitRank(rank {rank} of {world_size})")

    def all_reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, stream_handle: int,
                   op: str = "sum") -> None:
        """recv[i] = op over ranks of send[i] ("sum", or "max"), for `count` elements of `dtype`
        ("bfloat16", "float32" or "uint64"), enqueued on the stream (captured when the stream is
        capturing). send_ptr == recv_ptr reduces in place."""
        if op not in OP_CODES:
            raise ValueError(f"all_reduce op must be one of {', '.join(OP_CODES)}, got {op!r}")
        self._check_ready(dtype)
        _check(self.lib, self.lib.ncclAllReduce(ctypes.c_void_p(send_ptr), ctypes.c_void_p(recv_ptr), count,
                                                DTYPE_CODES[dtype], OP_CODES[op], self.comm,
                                                ctypes.c_void_p(stream_handle)),
               f"ncclAllReduce({count} x {dtype}, {op})")

    def all_gather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, stream_handle: int) -> None:
        """recv[r * count : (r + 1) * count] = rank r's send[0 : count], for every rank (the same
        count on every rank), enqueued on the stream."""
        self._check_ready(dtype)
        _check(self.lib, self.lib.ncclAllGather(ctypes.c_void_p(send_ptr), ctypes.c_void_p(recv_ptr), count,
                                                DTYPE_CODES[dtype], self.comm, ctypes.c_void_p(stream_handle)),
               f"ncclAllGather({count} x {dtype})")

    def broadcast_each(self, parts: list[tuple[int, int]], dtype: str, stream_handle: int) -> None:
        """One broadcast rooted at every rank, as one grouped operation: parts[r] = (ptr, count),
        rank r's `count` elements, sent from ptr on rank r and received at ptr on the others (so
        counts may differ by rank, as an uneven vocabulary split's do). Every rank passes the
        same counts in rank order, each its own pointers."""
        self._check_ready(dtype)
        if len(parts) != self.world_size:
            raise ValueError(f"broadcast_each needs one part per rank ({self.world_size}), got {len(parts)}")
        _check(self.lib, self.lib.ncclGroupStart(), "ncclGroupStart")
        try:
            for root, (ptr, count) in enumerate(parts):
                _check(self.lib, self.lib.ncclBroadcast(ctypes.c_void_p(ptr), ctypes.c_void_p(ptr), count,
                                                        DTYPE_CODES[dtype], root, self.comm,
                                                        ctypes.c_void_p(stream_handle)),
                       f"ncclBroadcast({count} x {dtype} from rank {root})")
        finally:
            _check(self.lib, self.lib.ncclGroupEnd(), "ncclGroupEnd")

    def _check_ready(self, dtype: str) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"NCCL dtype must be one of {', '.join(DTYPE_CODES)}, got {dtype!r}")
        if self.comm is None:
            raise NcclError("a collective on a destroyed communicator")

    def close(self) -> None:
        if self.comm is not None:
            _check(self.lib, self.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")
            self.comm = None
