"""A CudaRunner's shape without a device (CPU tests): the real LlamaModel.forward and GpuOps
launchers run, kernel launches and cuBLAS calls do nothing, and every pointer is address
arithmetic in an arena laid out by the real table. test_trace prints what the kernels would get;
test_handoff checks the counter chain's arguments."""
from __future__ import annotations

import ctypes

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.gpu.arena import ArenaDims, ArenaLayout, DeviceView, round_up
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.device_weights import DeviceWeights, LayerWeights, device_tensor_shapes, device_weight_bytes
from tinyvllm.gpu.model import LlamaModel, StepShape
from tinyvllm.gpu.ops import GpuOps


class Launches:             # a KernelLibrary whose functions enqueue nothing
    def function(self, name):
        return type("Fn", (), {"launch": lambda *a, **k: None, "max_dynamic_shared_bytes": 1 << 20})()


class FakeArena:
    def __init__(self, layout: ArenaLayout, base: int):
        self.layout, self.inputs_ptr = layout, base + layout.activation_bytes
        self._views = {}
        for start, ps in ((base, layout.activations), (self.inputs_ptr, layout.inputs),
                          (self.inputs_ptr + layout.input_bytes, layout.outputs)):
            self._views.update({p.name: DeviceView(p.name, start + p.offset, p.shape, p.dtype) for p in ps.values()})

    def view(self, name):
        return self._views[name]


class FakeKV:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, base: int):
        self.num_blocks, self.block_size, self.base = num_blocks, block_size, base
        self.layer_stride = num_blocks * block_size * config.kv_bytes_per_token // config.num_hidden_layers

    def k(self, layer):
        return self.base + layer * self.layer_stride

    def v(self, layer):
        return self.k(layer) + self.layer_stride // 2


class FakeCudaRunner:
    """CudaRunner's shape (arena, weights, kv_cache, ops, blas, graphs) without a device."""

    def __init__(self, config: ModelConfig, engine: EngineConfig):
        self.cfg, self.num_kv_blocks = config, 64
        self.arena = FakeArena(ArenaLayout.plan(ArenaDims.from_configs(config, engine)), 0x7F0000000000)
        ptrs, offset = {}, 0x7E0000000000
        for key, shape in device_tensor_shapes(config).items():
            ptrs[key] = offset
            offset += round_up(int(np.prod(shape)) * (4 if key == "rope_inv_freq" else 2))
        layers = tuple(LayerWeights(**{f: ptrs[f"{n}.{f}"] for f in LayerWeights.__dataclass_fields__})
                       for n in range(config.num_hidden_layers))
        self.weights = DeviceWeights(ptrs["embed"], ptrs["final_norm"], ptrs.get("lm_head", ptrs["embed"]),
                                     ptrs["rope_inv_freq"], layers, device_weight_bytes(config), 0x7E0000000000)
        self.kv_cache = FakeKV(config, self.num_kv_blocks, engine.block_size, 0x7D0000000000)
        self.blas = object.__new__(Cublas)          # the real matmul, a GemmEx that does nothing
        self.blas.observer, self.blas.handle = None, ctypes.c_void_p()
        self.blas._one, self.blas._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.blas.lib = type("Lib", (), {"cublasGemmEx": staticmethod(lambda *a: 0)})()
        self.ops = GpuOps(Launches(), blas=self.blas, num_sms=132, fuse=True)   # the fused decode layer
        self.model = LlamaModel(config, self.weights, self.arena, self.kv_cache, self.ops)
        self.graphs, self.replays = {1: None, 2: None}, []

    def memory_report(self):
        return "fake device\narena:\n" + self.arena.layout.memory_map()

    def execute(self, batch, sampling, replay=True):
        self.replays.append(replay)
        step = StepShape(batch.num_tokens, batch.num_seqs, batch.is_prefill, int(np.diff(batch.query_start).max()))
        self.model.forward(step)
        v = self.arena.view          # as CudaRunner._forward_and_sample (which needs PyCUDA to import)
        self.ops.sample(v("logits"), batch.num_seqs, self.cfg.vocab_size, v("temperature"), v("top_k"),
                        v("top_p"), v("seeds"), v("steps"), v("sampled_ids"), min_p=v("min_p"),
                        argmax_partials=v("argmax_partials"), slice_counters=v("argmax_slice_counters"),
                        head_argmax=self.model.head_argmax_for(step))
        return np.zeros(batch.num_seqs, np.int32)
