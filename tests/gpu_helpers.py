"""Device buffers for GPU tests: upload numpy arrays, poison outputs, read results back.
Imported only by tests marked `gpu` (it needs PyCUDA)."""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pycuda.driver as drv

BF16 = ml_dtypes.bfloat16
POISON = {np.dtype(BF16): np.uint16(0x7FC0), np.dtype(np.float32): np.uint32(0x7FC00000),
          np.dtype(np.int32): np.uint32(0x7FFFFFFF)}


class DeviceArray:
    """A device copy of a numpy array with the same dtype and shape."""

    def __init__(self, host: np.ndarray):
        self.host = np.ascontiguousarray(host)
        self._alloc = drv.mem_alloc(max(self.host.nbytes, 1))
        self.ptr = int(self._alloc)
        drv.memcpy_htod(self.ptr, self.host)

    @classmethod
    def poisoned(cls, shape, dtype) -> DeviceArray:
        """An output buffer filled with NaN (floats) / INT_MAX (ints): unwritten elements show."""
        dtype = np.dtype(dtype)
        pattern = POISON[dtype]
        return cls(np.full(shape, pattern, pattern.dtype).view(dtype))

    def get(self) -> np.ndarray:
        out = np.empty_like(self.host)
        drv.memcpy_dtoh(out, self.ptr)
        return out

    def __int__(self) -> int:
        return self.ptr

    __index__ = __int__   # so a DeviceArray can be passed straight to a 'P' kernel argument


def to_bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16)


def rel_err(got, want) -> float:
    r"""||got - want|| / ||want||, printed with the test's name (the error table in the notes
    comes from these lines: grep '^\[rel-err\]' in the log)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "output has NaN/inf (unwritten poison?)"
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]
    print(f"[rel-err] {test} {err:.2e}")
    return err


def shuffled_block_tables(rng, context_lens, block_size, num_blocks=None):
    """Disjoint, shuffled (non-contiguous) physical blocks per sequence."""
    need = [-(-c // block_size) for c in context_lens]
    total = num_blocks or sum(need) + 7
    perm = rng.permutation(total)
    tables, at = [], 0
    for n in need:
        tables.append([int(b) for b in perm[at:at + n]])
        at += n
    return tables, total
