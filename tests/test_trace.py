"""Trace mode and `inspect`, on the CPU. The GPU trace's formatting is driven through the real
LlamaModel.forward, GpuOps launchers and Cublas.matmul, with the device replaced by address
arithmetic: nothing is launched, every argument the kernels would get is printed."""
from __future__ import annotations

import ctypes
import io
import re
import subprocess
import sys

import numpy as np
import pytest

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import ForwardBatch, SamplingBatch
from tinyvllm.gpu.arena import INPUT_BANKS, ArenaDims, ArenaLayout, round_up
from tinyvllm.gpu.cublas import Cublas
from tinyvllm.gpu.device_weights import DeviceWeights, device_tensor_itemsize, device_tensor_shapes, device_weight_bytes
from tinyvllm.gpu.model import LlamaModel
from tinyvllm.gpu.ops import GpuOps
from tinyvllm.gpu.step_shape import StepShape
from tinyvllm.trace import TracingRunner


class _Launches:             # a KernelLibrary whose functions enqueue nothing
    def function(self, name):
        return type("Fn", (), {"launch": lambda *a, **k: None, "max_dynamic_shared_bytes": 1 << 20})()


class _FakeArena:
    def __init__(self, layout: ArenaLayout, base: int):
        self.layout, self.base = layout, base
        self._views = layout.views(base)

    def view(self, name, bank=None):
        return self._views[name if bank is None else (name, bank)]


class _FakeKV:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, base: int):
        self.num_blocks, self.block_size, self.base = num_blocks, block_size, base
        self.layer_stride = num_blocks * block_size * config.kv_bytes_per_token // config.num_hidden_layers

    def k(self, layer):
        return self.base + layer * self.layer_stride

    def v(self, layer):
        return self.k(layer) + self.layer_stride // 2


class _FakeCudaRunner:
    """CudaRunner's shape (arena, weights, kv_cache, ops, blas, graphs) without a device; its
    GpuOps takes EngineConfig's fused_decode and pdl as CudaRunner's does."""

    def __init__(self, config: ModelConfig, engine: EngineConfig):
        self.cfg, self.num_kv_blocks = config, 64
        self.arena = _FakeArena(ArenaLayout.plan(ArenaDims.from_configs(config, engine)), 0x7F0000000000)
        ptrs, offset = {}, 0x7E0000000000
        for key, shape in device_tensor_shapes(config).items():
            ptrs[key] = offset
            offset += round_up(int(np.prod(shape)) * device_tensor_itemsize(key))
        self.weights = DeviceWeights.at(config, ptrs, device_weight_bytes(config), 0x7E0000000000)
        self.kv_cache = _FakeKV(config, self.num_kv_blocks, engine.block_size, 0x7D0000000000)
        self.blas = object.__new__(Cublas)          # the real matmul, a GemmEx that does nothing
        self.blas.observer, self.blas.handle = None, ctypes.c_void_p()
        self.blas._one, self.blas._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.blas.lib = type("Lib", (), {"cublasGemmEx": staticmethod(lambda *a: 0)})()
        self.ops = GpuOps(_Launches(), blas=self.blas, num_sms=132, fused_decode=engine.fused_decode, pdl=engine.pdl)
        self.model = LlamaModel(config, self.weights, self.arena, self.kv_cache, self.ops)
        self.graphs, self.replays = {(size, bank): None for size in (1, 2) for bank in range(INPUT_BANKS)}, []

    def memory_report(self):
        return "fake device\narena:\n" + self.arena.layout.memory_map()

    def execute(self, batch, sampling, replay=True):
        self.replays.append(replay)
        step = StepShape(batch.num_tokens, batch.num_seqs, batch.is_prefill, int(np.diff(batch.query_start).max()))
        self.model.forward(step)
        v = self.arena.view          # as CudaRunner._sample (which needs PyCUDA to import)
        i = lambda name: v(name, step.bank)  # noqa: E731
        self.ops.sample(v("logits"), batch.num_seqs, self.cfg.vocab_size, i("temperature"), i("top_k"),
                        i("top_p"), i("seeds"), i("steps"), v("sampled_ids"), min_p=i("min_p"),
                        argmax_partials=v("argmax_partials"), slice_counters=v("argmax_slice_counters"),
                        head_argmax=self.model.head_argmax_for(step))
        return np.zeros(batch.num_seqs, np.int32)


def test_gpu_trace_names_every_argument(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, trace_steps=2)
    out = io.StringIO()
    fake = _FakeCudaRunner(config, engine)
    runner = TracingRunner(fake, config, engine, out=out)
    prompt = ForwardBatch.build([list(range(1, 12))], [11], [[5]], 16, is_prefill=True)   # 11 rows: cuBLAS
    runner.execute(prompt, SamplingBatch.greedy(1))
    runner.execute(ForwardBatch.build([[7]], [12], [[5]], 16, is_prefill=False), SamplingBatch.greedy(1))
    runner.execute(ForwardBatch.build([[8]], [13], [[5]], 16, is_prefill=False), SamplingBatch.greedy(1))
    text = out.getvalue()
    assert fake.replays == [False, False, True], "traced steps run eagerly, later ones replay graphs"
    steps = text.split("=== step ")[1:]
    assert len(steps) == 2, "only trace_steps steps are traced"
    prefill, decode = steps
    q = config.q_size + 2 * config.kv_size
    # prefill: the qkv projection on cuBLAS with the transposed-roles arguments of Cublas.matmul
    assert f"Y[11, {q}] = X[11, {config.hidden_size}] @ W[{q}, {config.hidden_size}]^T" in prefill
    assert (f"cublasGemmEx(transa=CUBLAS_OP_T, transb=CUBLAS_OP_N, m={q}, n=11, k={config.hidden_size}, alpha=1.0, "
            f"A=layers[0].qkv CUDA_R_16BF lda={config.hidden_size}, B=normed CUDA_R_16BF ldb={config.hidden_size}, "
            f"beta=0.0, C=qkv CUDA_R_16BF ldc={q}") in prefill
    assert "beta=1.0, C=hidden" in prefill                       # o and down add into the residual
    assert re.search(r"attention_prefill_d64 .*\n(?:.*\n)*?\s+k_cache\s+W?R?\s+kv\.k\(0\)", prefill)
    # kernel arguments by their C names, pointers resolved with read/write marks
    assert re.search(r"weight\s+R\s+layers\[0\]\.input_norm bfloat16 \(256,\) @weights\+", prefill)
    assert re.search(r"out\s+W\s+normed bfloat16", prefill)
    assert re.search(r"rows\s+W?R?\s+NULL", prefill)
    assert "-- layer 1 --" in prefill and "final norm + LM head" in prefill
    # decode: GEMV for the layer projections, split attention, the graph note, the sampler
    # decode at batch 1 runs the fused layer (gpu/model.py), five launches: qkv + RoPE/KV write,
    # attention, o (+ the next norm's operand), gate_up + silu, down (+ the next norm's operand);
    # every norm is handed over (the default): the first by the embedding, the final one by the
    # last down to the LM head, which runs on the GEMV with the norm's scale (no linear() at all)
    L = config.num_hidden_layers
    assert decode.count("gemv_prenormed_rope_kv_bf16  grid") == L
    assert decode.count("gemv_prenormed_silu_mul_bf16  grid") == L and decode.count("gemv_residual_norm_bf16  grid") == 2 * L
    assert decode.count("gemv_prenormed_bf16  grid") == 1 and "linear ->" not in decode
    head = decode[decode.index("gemv_prenormed_bf16  grid"):]
    assert re.search(r"w\s+R\s+(embed \(= lm_head\)|lm_head)", head) and re.search(r"row_ss\s+R\s+norm_row_ss", head)
    embedding = decode[decode.index("embedding_gather"):decode.index("gemv_prenormed_rope_kv_bf16")]
    assert re.search(r"norm_w\s+R\s+layers\[0\]\.input_norm", embedding) and re.search(r"row_ss\s+W\s+norm_row_ss", embedding)
    assert re.search(r"normed\s+W\s+normed\|final_normed bfloat16", decode)
    assert re.search(r"row_ss\s+W\s+norm_row_ss", decode) and re.search(r"row_ss\s+R\s+norm_row_ss", decode)
    assert re.search(r"k_cache\s+W\s+kv\.k\(0\)", decode)
    assert re.search(r"norm_w\s+R\s+layers\[0\]\.input_norm", decode)
    assert "silu_mul  grid" not in decode and "rope_write_kv" not in decode
    assert "rms_norm  grid" not in decode
    assert "attention_decode_d64_g2" in decode and "sample_tokens" in decode
    assert "replays the CUDA graph captured for 1 sequences" in decode
    assert "=== trace ends after 2 steps" in text
    assert "0x7" not in text, "every pointer resolves to a name"


def test_cpu_trace_and_inspect_commands(tiny_model_dir):
    run = lambda *a: subprocess.run([sys.executable, "-m", "tinyvllm", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    r = run("generate", "--model", str(tiny_model_dir), "--device", "cpu", "--trace-steps", "1",
            "--max-tokens", "2", "--temperature", "0", "Hello")
    assert r.returncode == 0, r.stderr
    for twin in ("embedding", "rms_norm", "linear", "apply_rope", "write_kv", "paged_attention", "silu_mul"):
        assert f"] {twin}(" in r.stderr
    assert "kv.k(0)" in r.stderr and "layers[1].down" in r.stderr and "=== step 2" not in r.stderr
    r = run("inspect", "--model", str(tiny_model_dir), "--max-model-len", "512", "--max-num-seqs", "8")
    assert r.returncode == 0, r.stderr
    config = ModelConfig.from_pretrained(tiny_model_dir)
    assert f"parameters: {config.num_parameters:,}" in r.stdout
    assert "model.layers.1.mlp.down_proj.weight" in r.stdout and "block_tables" in r.stdout
    assert f"one sequence at the context limit 512: {512 * config.kv_bytes_per_token:,} bytes" in r.stdout


def test_trace_steps_must_be_non_negative():
    import pytest
    with pytest.raises(ValueError, match="trace_steps"):
        EngineConfig(trace_steps=-1)


def _ops_of_a_decode_step(fake) -> list[tuple[str, dict]]:
    """(op, details) of every op one batch-1 decode step of the fake runner launches, in order."""
    launches = []
    fake.ops.observer = lambda op, repeat, details: launches.append((op, details))
    try:
        fake.execute(ForwardBatch.build([[7]], [12], [[5]], 16, is_prefill=False), SamplingBatch.greedy(1))
    finally:
        fake.ops.observer = None
    return launches


def _engine(**options) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, **options)


@pytest.mark.parametrize("fused_decode", [True, False])
def test_skip_ops_leaves_ops_out_of_a_step(tiny_model_dir, fused_decode):
    """GpuOps.skip_ops (benchmarks/decode_profile.py --leave-one-out): the named kernels and
    linear() projections are not launched (nor shown to the observer); every other op is. The
    fused decode layer (the default) is kernels only; the nine-launch layer has rms_norm
    launches and linear() projections, the LM head among them."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fake = _FakeCudaRunner(config, _engine(fused_decode=fused_decode))

    def ops_of_a_decode_step() -> list[str]:
        seen = []
        fake.ops.observer = lambda op, repeat, details: seen.append(op)
        try:
            fake.execute(ForwardBatch.build([[7]], [12], [[5]], 16, is_prefill=False), SamplingBatch.greedy(1))
        finally:
            fake.ops.observer = None
        return seen

    every = ops_of_a_decode_step()
    if fused_decode:
        skip = {"gemv_prenormed_bf16", "gemv_residual_norm_bf16"}
        assert "rms_norm" not in every and not any(op.startswith("gemv ") for op in every)
    else:
        skip = {"rms_norm", f"gemv {config.vocab_size}x{config.hidden_size}", "rope_write_kv"}
    assert skip <= set(every) and "sample_tokens" in every
    fake.ops.skip_ops = frozenset(skip)
    try:
        assert ops_of_a_decode_step() == [op for op in every if op not in fake.ops.skip_ops]
    finally:
        fake.ops.skip_ops = frozenset()
    assert ops_of_a_decode_step() == every


def test_sampler_launch_splits_the_argmax_by_vocabulary_and_batch():
    """GpuOps.sample_slices (sampling.cu's header): ARGMAX_SLICE_VALUES logits per block, at
    most MAX_ARGMAX_SLICES, about two blocks per SM in all; the launch's grid is (rows, slices)
    with the workspace and (rows, 1) without it; a slice count it cannot honour is an error."""
    from tinyvllm.gpu.ops import MAX_ARGMAX_SLICES, SAMPLING
    ops = GpuOps(_Launches(), num_sms=132)
    assert SAMPLING["ARGMAX_SLICE_VALUES"] == 4096 and MAX_ARGMAX_SLICES == 32
    assert [ops.sample_slices(1, v) for v in (128256, 49152, 4097, 4096, 7)] == [32, 12, 2, 1, 1]
    assert [ops.sample_slices(s, 128256) for s in (8, 9, 64, 132, 264, 1000)] == [32, 29, 4, 2, 1, 1]
    grids = []
    ops.observer = lambda op, repeat, details: grids.append(details["grid"])
    ops.sample(0x1000, 1, 128256, 0, 0, 0, 0, 0, 0, argmax_partials=0x2000, slice_counters=0x3000)
    ops.sample(0x1000, 64, 49152, 0, 0, 0, 0, 0, 0, argmax_partials=0x2000, slice_counters=0x3000)
    ops.sample(0x1000, 3, 128256, 0, 0, 0, 0, 0, 0)                       # no workspace: one block
    ops.sample(0x1000, 3, 128256, 0, 0, 0, 0, 0, 0, argmax_partials=0x2000, slice_counters=0x3000, slices=7)
    assert grids == [(1, 32, 1), (64, 4, 1), (3, 1, 1), (3, 7, 1)]
    with pytest.raises(ValueError, match="need argmax_partials"):
        ops.sample(0x1000, 3, 128256, 0, 0, 0, 0, 0, 0, slices=4)
    with pytest.raises(ValueError, match="slices must be in 1..32"):
        ops.sample(0x1000, 3, 128256, 0, 0, 0, 0, 0, 0, argmax_partials=0x2000, slice_counters=0x3000, slices=33)
    # the LM head's argmax keys replace the argmax pass: one block per row, whatever the workspace
    grids.clear()
    ops.sample(0x1000, 1, 128256, 0, 0, 0, 0, 0, 0, argmax_partials=0x2000, slice_counters=0x3000, head_argmax=0x4000)
    assert grids == [(1, 1, 1)]
    with pytest.raises(ValueError, match="no argmax pass to split"):
        ops.sample(0x1000, 1, 128256, 0, 0, 0, 0, 0, 0, slices=4, head_argmax=0x4000)


def test_decode_layer_hands_the_norms_over(tiny_model_dir):
    """The fused decode layer (gpu/model.py): every norm is handed over by the kernel before it —
    the embedding gather the first input norm, the o and every down GEMV (gemv_residual_norm) the
    next one, the last down the final norm — each writing `normed` (with that norm's gain) and
    `norm_row_ss`; the qkv and gate_up GEMVs and the LM head (gemv_prenormed_bf16, fp32 logits)
    read exactly those. Five launches a layer; no rms_norm, rope_write_kv or silu_mul."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fake = _FakeCudaRunner(config, _engine())
    assert fake.ops.fused_decode and fake.ops.pdl, "EngineConfig's defaults"
    launches = _ops_of_a_decode_step(fake)
    L, v, w = config.num_hidden_layers, fake.arena.view, fake.weights
    names = [op for op, _ in launches]
    assert not {"rms_norm", "rope_write_kv", "silu_mul"} & set(names) and not any(op.startswith("gemv ") for op in names)
    assert names.count("gemv_prenormed_rope_kv_bf16") == L and names.count("gemv_prenormed_silu_mul_bf16") == L
    assert len(names) == 1 + 5 * L + 2     # the embedding, five a layer, the LM head and the sampler
    embedding = launches[names.index("embedding_gather")][1]["args"]   # (..., norm_w, normed, row_ss, head_argmax)
    assert tuple(map(int, embedding[-4:])) == (int(w.layers[0].input_norm), int(v("normed")), int(v("norm_row_ss")),
                                               int(v("head_argmax")))
    producers = [d["args"] for op, d in launches if op == "gemv_residual_norm_bf16"]
    assert len(producers) == 2 * L
    gains = [g for lw, nxt in zip(w.layers, [*w.layers[1:], None])
             for g in (lw.post_norm, nxt.input_norm if nxt else w.final_norm)]
    for args, gain in zip(producers, gains):    # (y, x, w, m, n, k, norm_w, normed, row_ss, ...)
        assert args[0] == int(v("hidden")) and args[3:6] == (1, config.hidden_size, args[5])
        assert args[6:9] == (gain, int(v("normed")), int(v("norm_row_ss")))
    for op, d in launches:
        if "prenormed" in op:                   # (y, x, row_ss, w, m, n, k, eps, ...)
            assert d["args"][1] == int(v("normed")) and d["args"][2] == int(v("norm_row_ss"))
            assert d["args"][6] == config.hidden_size and d["shared_bytes"] > 0
    # the LM head (y, x, row_ss, w, m, n, k, eps, out_f32, head_argmax, ...) keeps the greedy argmax
    # keys the sampler then reads instead of the logits (one block per row, no workspace)
    head = launches[names.index("gemv_prenormed_bf16")][1]["args"]
    assert head[0] == int(v("logits")) and head[3] == w.lm_head and head[5] == config.vocab_size and head[8] == 1
    assert int(head[9]) == int(v("head_argmax"))
    assert names.index("gemv_prenormed_bf16") == len(names) - 2 and names[-1] == "sample_tokens"
    sampler = launches[-1][1]
    assert sampler["grid"] == (1, 1, 1) and int(sampler["args"][-2]) == int(v("head_argmax"))   # (..., head_argmax, out_host)
    assert names.index("gemv_residual_norm_bf16") > names.index("attention_decode_d64_g2")


def test_unfused_decode_layer_launches_the_nine(tiny_model_dir):
    """EngineConfig(fused_decode=False) (--no-fused-decode): a decode step runs the nine launches
    per layer the guide follows — rms_norm, qkv linear(), rope_write_kv, the decode attention, o
    linear() adding into the residual, rms_norm, gate_up linear(), silu_mul, down linear() — then
    the final norm of the last tokens and the LM head as a linear(), on the plain GEMV; the
    embedding hands nothing over and the sampler runs its own argmax pass."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fake = _FakeCudaRunner(config, _engine(fused_decode=False))
    assert not fake.ops.fused_decode
    launches = _ops_of_a_decode_step(fake)
    names = [op for op, _ in launches]
    H, I, q = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
    layer = ["rms_norm", f"gemv {q}x{H}", "rope_write_kv", "attention_decode_d64_g2", f"gemv {H}x{config.q_size}",
             "rms_norm", f"gemv {2 * I}x{H}", "silu_mul", f"gemv {H}x{I}"]
    assert names == (["embedding_gather"] + layer * config.num_hidden_layers
                     + ["rms_norm", f"gemv {config.vocab_size}x{H}", "sample_tokens"])
    assert launches[0][1]["args"][-4:] == (0, 0, 0, 0)          # no norm handed over, no argmax keys
    residual_adds = [d for op, d in launches if op in (f"gemv {H}x{config.q_size}", f"gemv {H}x{I}")]
    assert all(d["accumulate"] and d["y"] == fake.arena.view("hidden") for d in residual_adds)
    head = launches[-2][1]
    assert head["last"] and head["out_dtype"] == "float32" and head["x"] == fake.arena.view("final_normed")
    sampler = launches[-1][1]          # no head_argmax keys: the argmax pass in its slices
    assert int(sampler["args"][-2]) == 0 and sampler["grid"] == (1, fake.ops.sample_slices(1, config.vocab_size), 1)


@pytest.mark.parametrize("fused_decode", [True, False])
def test_decode_layer_k_warps_follow_the_rule(tiny_model_dir, fused_decode):
    """Every decode GEMV launches with gemv_k_warps' rule (block = 32 x warps), on both layers:
    the o GEMV's at most half an SM per CTA (it follows the attention), the LM head by its `last`
    rule."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    fake = _FakeCudaRunner(config, _engine(fused_decode=fused_decode))
    ops, H, I = fake.ops, config.hidden_size, config.intermediate_size
    launched = []

    class Recording:              # every kernel launch's (name, block, args), enqueueing nothing
        def function(self, name):
            def launch(grid, block, stream, args, shared_bytes, pdl):
                launched.append((name, block, args))
            return type("Fn", (), {"launch": staticmethod(launch), "max_dynamic_shared_bytes": 1 << 20})()

    ops.library = Recording()
    fake.execute(ForwardBatch.build([[7]], [12], [[5]], 16, is_prefill=False), SamplingBatch.greedy(1))
    seen = {}
    for name, block, a in launched:     # (y, x, w, m, n, k ...); prenormed: (y, x, row_ss, w, m, n, k ...)
        if name.startswith("gemv"):
            n, k = (a[4], a[5]) if name in ("gemv_bf16", "gemv_residual_norm_bf16") else (a[5], a[6])
            seen.setdefault((n, k), set()).add(block[0] // 32)
    o, head = (H, config.q_size), (config.vocab_size, H)
    want = {(n, k): {ops.gemv_k_warps(n, k, beside_attention=(n, k) == o)}
            for n, k in ((config.q_size + 2 * config.kv_size, H), o, (2 * I, H), (H, I))}
    want[head] = {ops.gemv_k_warps(*head, last=True)}
    assert seen == want
    # the o rule: at most half an SM per CTA (Llama-1B's 32 warps -> 16; SmolLM2's 8 stay)
    assert (ops.gemv_k_warps(2048, 2048), ops.gemv_k_warps(2048, 2048, beside_attention=True)) == (32, 16)
    assert ops.gemv_k_warps(576, 576) == ops.gemv_k_warps(576, 576, beside_attention=True) == 8
