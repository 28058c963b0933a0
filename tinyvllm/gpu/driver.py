"""The CUDA device as the engine uses it: PyCUDA's driver, initialised once, and the device's
primary context made current for a block of work; and the few driver-API calls PyCUDA does not
wrap, bound here once over ctypes: module loading and cuLaunchKernelEx (for programmatic
dependent launch, see gpu/kernels.py) and the graph calls of gpu/graphs.py.

The primary context can be made current from whichever thread drives the engine (the server
runs it on a background thread), so every entry point into the GPU backend wraps its work in
`with device.active():` instead of pushing and popping by hand.
"""
from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager

from tinyvllm.errors import GPUUnavailableError


class CudaDevice:
    """GPU 0 and its primary context. Raises GPUUnavailableError (one line: why, and --device
    cpu) when there is no usable driver or device."""

    def __init__(self, ordinal: int = 0):
        import pycuda.driver as drv
        try:
            drv.init()
            count = drv.Device.count()
        except drv.Error as e:
            raise GPUUnavailableError(f"no usable CUDA driver ({e}); use --device cpu") from None
        if count <= ordinal:
            raise GPUUnavailableError("no CUDA device found; use --device cpu")
        self.drv = drv
        self.device = drv.Device(ordinal)
        self.name = self.device.name()
        self.num_sms = self.device.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.context = self.device.retain_primary_context()

    @contextmanager
    def active(self):
        self.context.push()
        try:
            yield self
        finally:
            self.context.pop()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return self.drv.mem_get_info()


class CudaDriverError(RuntimeError):
    pass


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padding to 8 bytes, a 64-byte value union whose first
    three words are more than the one attribute used here needs (a flag in value[0])."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 3),
                ("rest", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def load_enqueue_library(path: str) -> ctypes.PyDLL:
    """A CUDA library whose calls keep the GIL (ctypes.PyDLL, not CDLL). Launches, cuBLAS calls and
    graph launches only enqueue work (microseconds); a CDLL call releases the GIL and must win it
    back, and while the server's event loop thread is busy that wait is up to the interpreter's
    switch interval (5 ms) per call. An eager prefill-kind step makes ~180 such calls: on one
    x86-64 core (2026-12-07), 180 CDLL calls beside one busy Python thread took 32 ms, as PyDLL
    calls 0.07 ms (the server's mixed load gained 2.6 %: perf-notes). The calls that do wait for
    the GPU (stream and event synchronize) are PyCUDA's, which release the GIL."""
    return ctypes.PyDLL(path)


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.PyDLL:
    lib = load_enqueue_library("libcuda.so.1")
    vp, pvp, i32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
    lib.cuModuleLoadData.argtypes = [pvp, ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [pvp, vp, ctypes.c_char_p]
    lib.cuModuleUnload.argtypes = [vp]
    lib.cuFuncSetAttribute.argtypes = [vp, i32, i32]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), vp, pvp, pvp]
    lib.cuStreamBeginCapture_v2.argtypes = [vp, i32]
    lib.cuStreamEndCapture.argtypes = [vp, pvp]
    lib.cuGraphInstantiateWithFlags.argtypes = [pvp, vp, ctypes.c_ulonglong]
    lib.cuGraphLaunch.argtypes = [vp, vp]
    lib.cuGraphExecDestroy.argtypes = [vp]
    lib.cuGraphDestroy.argtypes = [vp]
    lib.cuGetErrorString.argtypes = [i32, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def check(status: int, what: str) -> None:
    """Raise CudaDriverError with the driver's own message for a failed CUresult."""
    if status != 0:
        msg = ctypes.c_char_p()
        libcuda().cuGetErrorString(status, ctypes.byref(msg))
        raise CudaDriverError(f"{what} failed: {(msg.value or b'?').decode()} (CUresult {status})")
