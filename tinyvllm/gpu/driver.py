"""The CUDA device as the engine uses it: PyCUDA's driver, initialised once, and the device's
primary context made current for a block of work.

The primary context can be made current from whichever thread drives the engine (the server
runs it on a background thread), so every entry point into the GPU backend wraps its work in
`with device.active():` instead of pushing and popping by hand.
"""
from __future__ import annotations

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
