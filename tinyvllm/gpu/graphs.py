"""CUDA graphs through the driver API over ctypes, on PyCUDA streams.

A decode step is ~150 launches; from Python each costs ~8 µs, so an eager step is host-bound.
Captured once into a graph and replayed, the same launches cost ~1 µs each on the GPU and one
cuGraphLaunch on the host. PyCUDA has no graph API, so the driver calls we need are bound over
ctypes (gpu/driver.py); capture works on a PyCUDA stream's handle, and captures PyCUDA kernel launches and cuBLAS
calls alike (cuBLAS needs a fixed workspace for that: see Cublas).

Everything a captured step reads must sit at fixed addresses (the arena) and every kernel
argument must be the same at replay: per-step values (token ids, block tables, even the block
table width) are written into the arena's input views before each launch.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager

from tinyvllm.gpu.driver import check, libcuda

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1   # only this thread's CUDA calls join the capture


class CudaGraph:
    """One captured, instantiated graph. Build with `CudaGraph.capture(stream)`."""

    def __init__(self):
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()

    @classmethod
    @contextmanager
    def capture(cls, stream):
        """`with CudaGraph.capture(stream) as graph: <enqueue work on stream>` — the work is
        recorded, not run; the graph is instantiated on exit."""
        lib = libcuda()
        graph = cls()
        handle = ctypes.c_void_p(stream.handle)
        check(lib.cuStreamBeginCapture_v2(handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        try:
            yield graph
        finally:
            # always end the capture, or the stream stays unusable
            ended = lib.cuStreamEndCapture(handle, ctypes.byref(graph._graph))
        check(ended, "cuStreamEndCapture")
        check(lib.cuGraphInstantiateWithFlags(ctypes.byref(graph._exec), graph._graph, 0),
              "cuGraphInstantiate")

    def launch(self, stream) -> None:
        check(libcuda().cuGraphLaunch(self._exec, ctypes.c_void_p(stream.handle)), "cuGraphLaunch")

    def close(self) -> None:
        lib = libcuda()
        if self._exec:
            lib.cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph:
            lib.cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()
