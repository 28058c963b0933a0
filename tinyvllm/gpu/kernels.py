"""Compile cuda/*.cu with PyCUDA and launch kernels through prepared calls.

Every kernel's argument types live in KERNEL_SIGNATURES, the one table that ties a kernel name to
its C signature (struct-module letters: P pointer, i int32, I uint32, f float32, Q uint64).
Each .cu file is one SourceModule compiled for the device's own arch (sm_90 on an H200);
PyCUDA caches the cubin on disk keyed by source and options, so only the first start compiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pycuda.driver as drv
from pycuda.compiler import SourceModule

CUDA_DIR = Path(__file__).resolve().parent / "cuda"     # package data: ships in the wheel

KERNEL_SIGNATURES: dict[str, str] = {
    # cuda/embedding.cu: out, table, token_ids, num_tokens, hidden, vocab_size
    "embedding_gather": "PPPiii",
    # cuda/rmsnorm.cu: out, in, weight, rows (nullable), num_rows, hidden, eps
    "rms_norm": "PPPPiif",
    # cuda/activation.cu: out, gate_up, num_tokens, inter
    "silu_mul": "PPii",
    # cuda/rope_kv.cu: qkv, k_cache, v_cache, positions, slot_mapping, inv_freq,
    #                  num_tokens, num_q_heads, num_kv_heads, head_dim
    "rope_write_kv": "PPPPPPiiii",
    # cuda/attention_prefill.cu: out, q, q_row_stride, k_cache, v_cache, block_tables,
    #   block_table_width (device int), query_start, context_lens, block_size, num_kv_heads,
    #   group, scale
    "attention_prefill_d64": "PPiPPPPPPiiif",
    "attention_prefill_d128": "PPiPPPPPPiiif",
}
# cuda/attention_decode.cu, one kernel per (head_dim, GQA group): out, partial_out, partial_ml,
#   split_counters, q, q_row_stride, k_cache, v_cache, block_tables, block_table_width (device
#   int), context_lens, block_size, num_kv_heads, scale
DECODE_GROUPS = (1, 2, 3, 4, 8)
KERNEL_SIGNATURES.update({f"attention_decode_d{d}_g{g}": "PPPPPiPPPPPiif"
                          for d in (64, 128) for g in DECODE_GROUPS})


def register(signatures: dict[str, str]) -> None:
    """Kernel wrapper modules declare their kernels' signatures here at import."""
    for name, sig in signatures.items():
        if KERNEL_SIGNATURES.get(name, sig) != sig:
            raise ValueError(f"kernel {name} registered twice with different signatures")
        KERNEL_SIGNATURES[name] = sig


def device_arch() -> str:
    major, minor = drv.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


@dataclass
class Kernel:
    name: str
    function: drv.Function
    stream: drv.Stream | None      # the library's stream; None = the default stream

    def __call__(self, grid, block, *args, shared_bytes: int = 0, stream: drv.Stream | None = None):
        """Launch on `stream`, by default the library's. grid/block: an int or a tuple of up to 3."""
        self.function.prepared_async_call(_dim3(grid), _dim3(block), stream or self.stream, *args,
                                          shared_size=shared_bytes)


def _dim3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


class KernelLibrary:
    """All kernels of cuda/*.cu, compiled once per process, looked up by name."""

    def __init__(self, stream: drv.Stream | None = None, cuda_dir: Path = CUDA_DIR,
                 extra_options: tuple[str, ...] = ()):
        self.arch = device_arch()
        self.stream = stream
        self._modules: dict[str, SourceModule] = {}
        # No --use_fast_math: RoPE needs sincosf's full range reduction at large positions;
        # kernels ask for fast intrinsics (__expf) explicitly where they are safe.
        options = ["-std=c++17", "-O3", *extra_options]
        for path in sorted(cuda_dir.glob("*.cu")):
            self._modules[path.stem] = SourceModule(
                path.read_text(), arch=self.arch, no_extern_c=True, options=options,
                include_dirs=[str(cuda_dir)])
        self._kernels: dict[str, Kernel] = {}

    def __getitem__(self, name: str) -> Kernel:
        if name not in self._kernels:
            if name not in KERNEL_SIGNATURES:
                raise KeyError(f"kernel {name!r} has no entry in KERNEL_SIGNATURES")
            for module in self._modules.values():
                try:
                    fn = module.get_function(name)
                except drv.LogicError:
                    continue
                fn.prepare(KERNEL_SIGNATURES[name])
                self._kernels[name] = Kernel(name, fn, self.stream)
                break
            else:
                raise KeyError(f"kernel {name!r} not found in {sorted(self._modules)}")
        return self._kernels[name]
