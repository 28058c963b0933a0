"""What every launcher family shares: the kernel library, stream, cuBLAS handle and SM count the
launchers are bound to, the two switches EngineConfig gives them, and `_launch`, through which
every kernel launch goes.

`_launch` takes a kernel's name, grid, block and arguments in the kernel's own order (their C
types come from the .cu signature: gpu/kernels.py). Two hooks see the ops of a step:
  * `observer(op, repeat, details)`, when set, is called before each op with a zero-argument
    callable that enqueues the same op again (trace.py prints the ops;
    benchmarks/decode_profile.py times them). A projection (linear()) is one op, whatever it
    launches inside.
  * `skip_ops`, kernel names or linear()'s "gemv NxK" / "cublas NxK", are left out of every
    step (decode_profile.py --leave-one-out measures each op's in-graph cost so).
"""
from __future__ import annotations


def _dim3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


class OpsBase:
    """The launchers' binding: one kernel library, stream, cuBLAS handle and SM count.

    fused_decode (EngineConfig.fused_decode): a decode step of at most GEMV_MAX_ROWS sequences
    runs the fused five-launch layer (gpu/model.py); off, every step runs the nine separate
    launches per layer. pdl (EngineConfig.pdl): our kernels launch with programmatic dependent
    launch (gpu/kernels.py); off, each waits for the one before it to end, for debugging. The
    same bits either way for pdl; the fused layer's handed-over norms change bits (gemv.cu's
    header)."""

    def __init__(self, library, stream=None, blas=None, num_sms: int | None = None, *,
                 fused_decode: bool = True, pdl: bool = True):
        if num_sms is None:
            import pycuda.driver as drv
            num_sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.library, self.stream, self.blas, self.num_sms = library, stream, blas, int(num_sms)
        self.stream_handle = stream.handle if stream is not None else 0
        self.fused_decode, self.pdl = fused_decode, pdl
        self.skip_ops: frozenset[str] = frozenset()
        # None (the default) costs one attribute test per op
        self.observer = None
        self._in_linear = False

    def _launch(self, kernel: str, grid, block, *args, shared_bytes: int = 0) -> None:
        fn, grid, block = self.library.function(kernel), _dim3(grid), _dim3(block)
        if shared_bytes > fn.max_dynamic_shared_bytes:
            # once per kernel and size, outside any capture (each graph's launches run eagerly first)
            fn.set_max_dynamic_shared_bytes(shared_bytes)
        launch = lambda: fn.launch(grid, block, self.stream_handle, args, shared_bytes, self.pdl)  # noqa: E731
        if self.skip_ops and not self._in_linear and kernel in self.skip_ops:
            return
        if self.observer is not None and not self._in_linear:
            self.observer(kernel, launch, {"grid": grid, "block": block, "args": args, "shared_bytes": shared_bytes})
        launch()

    def _quietly(self, run):
        """`run` with the observer told nothing of the kernels inside it (linear is one op)."""
        def quiet():
            self._in_linear = True
            try:
                run()
            finally:
                self._in_linear = False
        return quiet
