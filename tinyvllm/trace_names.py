"""What a trace calls each argument: the arrays of the reference model (--device cpu) and the
device pointers of the CUDA runner, named by the weight, arena buffer or KV-cache layer they
point into (tinyvllm/trace.py prints them).
"""
from __future__ import annotations

import bisect
import re

import numpy as np

from tinyvllm.config import ModelConfig
from tinyvllm.model_report import weight_label


class ArrayNames:
    """Names of the reference model's arrays (weights by identity, KV cache by address)."""

    def __init__(self, model, kv_cache: np.ndarray, config: ModelConfig):
        self._by_id = {id(model.embed): "embed", id(model.final_norm): "final_norm"}
        if model.lm_head is not model.embed:
            self._by_id[id(model.lm_head)] = "lm_head"
        else:
            self._by_id[id(model.embed)] = "embed (= lm_head)"
        for layer, parts in enumerate(model.layers):
            self._by_id.update({id(w): f"layers[{layer}].{part}" for part, w in parts.items()})
        self._by_addr = {}
        for layer in range(config.num_hidden_layers):
            for kv, which in ((0, "k"), (1, "v")):
                view = kv_cache[layer, kv]
                self._by_addr[(view.__array_interface__["data"][0], view.shape)] = f"kv.{which}({layer})"

    def label(self, a) -> str | None:
        if id(a) in self._by_id:
            return self._by_id[id(a)]
        if isinstance(a, np.ndarray):
            return self._by_addr.get((a.__array_interface__["data"][0], a.shape))
        return None

    @staticmethod
    def describe(a, label) -> str:
        if isinstance(a, np.ndarray):
            return f"{label + ' ' if label else ''}{a.dtype} {a.shape}"
        if hasattr(a, "is_prefill"):
            return f"batch({'prefill' if a.is_prefill else 'decode'}, T={a.num_tokens}, S={a.num_seqs})"
        if hasattr(a, "nbytes") and hasattr(a, "shape"):      # a quantized weight (FP8, GGUF blocks)
            from tinyvllm.quant.weight_kinds import kind_name
            return f"{label + ' ' if label else ''}{kind_name(a)} {a.shape}"
        return f"{a:.6g}" if isinstance(a, float) else repr(a)


class PointerNames:
    """Device pointers -> what they point into: arena buffers (the DeviceViews the model passes
    carry their names), weight tensors and KV-cache layers (plain ints, found by address)."""

    def __init__(self, runner, config: ModelConfig):
        from tinyvllm.checkpoint.weight_names import layer_parts
        from tinyvllm.gpu.device_weights import device_tensor_itemsize, device_tensor_shapes
        self.recent: dict[int, tuple] = {}       # the current linear()'s pointers, for its GemmEx
        self._params: dict[str, tuple[str, ...]] = {}
        arena, layout, regions = runner.arena, runner.arena.layout, []
        self.arena_base = arena.base
        placements = {**layout.activations, **layout.inputs, **layout.outputs}
        by_address: dict[int, list] = {}
        for key, view in layout.views(arena.base).items():      # inputs by (name, bank)
            label = key if isinstance(key, str) else f"{key[0]}[bank {key[1]}]"
            by_address.setdefault(view.ptr, []).append((placements[view.name], label))
        for ptr, ps in by_address.items():         # storage shared by buffers: name them all
            big = max((p for p, _ in ps), key=lambda p: p.nbytes)
            regions.append((ptr, big.nbytes, "|".join(label for _, label in ps), big.shape, big.dtype,
                            f"arena+{ptr - self.arena_base:,}"))
        w, shapes = runner.weights, device_tensor_shapes(config)
        ptrs = {"embed": w.embed, "final_norm": w.final_norm, "rope_inv_freq": w.rope_inv_freq}
        if w.sliding_rope_inv_freq:
            ptrs["sliding_rope_inv_freq"] = w.sliding_rope_inv_freq
        if w.nope_rope_inv_freq:
            ptrs["nope_rope_inv_freq"] = w.nope_rope_inv_freq
        if not config.tie_word_embeddings:
            ptrs["lm_head"] = w.lm_head
        for n, lw in enumerate(w.layers):
            ptrs.update({f"{n}.{f}": getattr(lw, f) for f in layer_parts(config)})
        base = int(w.allocation)
        for key, ptr in ptrs.items():
            if hasattr(ptr, "kind"):          # a quantized matrix (gpu/quant_weights.py): its planes
                regions.append((ptr.data, ptr.nbytes, weight_label(key), (ptr.rows, ptr.cols), ptr.kind,
                                f"weights+{ptr.data - base:,}"))
                continue
            size = device_tensor_itemsize(key)
            label = "embed (= lm_head)" if key == "embed" and config.tie_word_embeddings else weight_label(key)
            regions.append((ptr, int(np.prod(shapes[key])) * size, label, shapes[key],
                            "float32" if size == 4 else "bfloat16", f"weights+{ptr - base:,}"))
        kv, kv_shape = runner.kv_cache, (runner.kv_cache.num_blocks * runner.kv_cache.block_size,
                                         config.num_key_value_heads, config.head_dim)
        for layer in range(config.num_hidden_layers):
            for which, ptr in (("k", kv.k(layer)), ("v", kv.v(layer))):
                regions.append((ptr, kv.layer_stride // 2, f"kv.{which}({layer})", kv_shape, "bfloat16",
                                f"kv+{ptr - kv.base:,}"))
        self.regions = sorted(regions)
        self.starts = [r[0] for r in self.regions]

    def pointer(self, value) -> tuple[str, str | None]:
        """(description, label) of a pointer argument."""
        if hasattr(value, "shape") and hasattr(value, "ptr"):        # an arena DeviceView
            return (f"{value.name} {value.dtype} {value.shape} @arena+{value.ptr - self.arena_base:,}",
                    value.name)
        p = value.data if hasattr(value, "kind") else int(value)    # a QuantMatrix: its quants plane
        if p == 0:
            return "NULL", None
        i = bisect.bisect_right(self.starts, p) - 1
        if i >= 0 and p < self.regions[i][0] + self.regions[i][1]:
            start, _, label, shape, dtype, where = self.regions[i]
            inside = f" +{p - start:,} B" if p != start else ""
            return f"{label}{inside} {dtype} {shape} @{where}", label
        return hex(p), None

    def kernel_params(self, kernel: str) -> tuple[str, ...]:
        if kernel not in self._params:
            from tinyvllm.gpu.kernels import find_kernel, kernel_parameters
            filename, key = find_kernel(kernel)
            self._params[kernel] = kernel_parameters(filename)[key]
        return self._params[kernel]

    def argument(self, decl: str, value) -> tuple[str, str | None]:
        """(line, label) of one kernel argument, named by its C parameter declaration."""
        name = re.findall(r"\w+", decl)[-1]
        if "*" not in decl:
            shown = f"{value:.6g}" if isinstance(value, float) else value
            return f"      {name:<20}    {shown}", None
        desc, label = self.pointer(value)
        return f"      {name:<20}{'R' if decl.startswith('const') else 'W'}   {desc}", label
