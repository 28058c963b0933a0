"""Trace mode (`generate --trace`, `LLM(..., trace=True)`, EngineConfig.trace_steps): every
kernel launch and cuBLAS call of the first N steps of a real generation, in order, on stderr.

On the GPU each launch shows its kernel, grid and block, and every argument by its C parameter
name (read from the kernel's .cu signature): pointers resolved to the arena buffer, weight
tensor or KV-cache layer they point into, with shape, dtype and byte offset; `const` pointers are
read (R), the others written (W; some are also read: rope_write_kv rotates qkv in place, a
linear with beta = 1 adds into hidden). cuBLAS calls show cublasGemmEx's own arguments next to
the row-major product they compute. Traced steps run eagerly; a decode step runs the very
launches its CUDA graph would replay (padded to the graph's batch size), so the list is the
graph's. On --device cpu the trace lists the numpy twins that stand in for the kernels.

Arguments are named by what they point into (tinyvllm/trace_names.py). Nothing here runs unless
tracing is on: the engine wraps its runner in TracingRunner only then, and the hooks it sets
(GpuOps.observer, Cublas.observer, ReferenceModel.observer) are None otherwise.
"""
from __future__ import annotations

import re
import sys

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model_report import arena_layout, device_weight_lines, kv_cache_lines
from tinyvllm.trace_names import ArrayNames, PointerNames

TRACE_STEPS = 2                   # what trace=True / --trace alone traces: the prefill and one decode
SHOW = 12                         # entries of a per-token array shown in a step header

# twin (tinyvllm/reference/) -> the GPU work it stands in for
TWIN_OF = {
    "embedding": "embedding.cu::embedding_gather",
    "rms_norm": "rmsnorm.cu::rms_norm",
    "linear": "gpu/ops/gemv.py::GemvOps.linear (gemv.cu::gemv_bf16 or cublasGemmEx)",
    "apply_rope": "rope_kv.cu::rope_write_kv (rotation)",
    "write_kv": "rope_kv.cu::rope_write_kv (paged K/V write)",
    "paged_attention": "attention_prefill.cu / attention_decode.cu",
    "cascade_paged_attention": "attention_decode.cu (from the prefix's end) + attention_cascade.cu (prefix, merge)",
    "silu_mul": "activation.cu::silu_mul",
}
CUBLAS_NAMES = {"transa": {0: "CUBLAS_OP_N", 1: "CUBLAS_OP_T"}, "transb": {0: "CUBLAS_OP_N", 1: "CUBLAS_OP_T"},
                "Atype": {0: "CUDA_R_32F", 14: "CUDA_R_16BF"}, "Btype": {0: "CUDA_R_32F", 14: "CUDA_R_16BF"},
                "Ctype": {0: "CUDA_R_32F", 14: "CUDA_R_16BF"}, "computeType": {68: "CUBLAS_COMPUTE_32F"},
                "algo": {-1: "CUBLAS_GEMM_DEFAULT"}}


def _short(a) -> str:
    a = np.asarray(a).reshape(-1)
    body = " ".join(str(int(x)) for x in a[:SHOW])
    return f"[{body}{' ...' if len(a) > SHOW else ''}] ({len(a)})"


def batch_lines(batch) -> list[str]:
    """A ForwardBatch as the kernels will see it."""
    return [f"  token_ids    {_short(batch.token_ids)}", f"  positions    {_short(batch.positions)}",
            f"  slot_mapping {_short(batch.slot_mapping)}   (slot = block_table[pos // block_size] * block_size + pos % block_size)",
            f"  query_start  {_short(batch.query_start)}   context_lens {_short(batch.context_lens)}",
            *(f"  block_tables[{i}] {_short(row)}" for i, row in enumerate(batch.block_tables[:4])),
            *(["  ..."] if len(batch.block_tables) > 4 else []),
            *([f"  common_prefix_blocks {batch.common_prefix_blocks}   (cascade attention: read once for all)"]
              if batch.common_prefix_blocks else [])]


class TracingRunner(ModelRunner):
    """Wraps a CudaRunner or NumpyRunner: the first `trace_steps` steps are printed, op by op.
    Its steps run one at a time (ModelRunner.launch's default: no async overlap), so that each
    trace shows one step's launches in order."""

    # the wrapped runner's (ModelRunner's class defaults would hide them from __getattr__)
    supports_logprobs = property(lambda self: self.inner.supports_logprobs)
    supports_prompt_logprobs = property(lambda self: self.inner.supports_prompt_logprobs)
    last_logprobs = property(lambda self: self.inner.last_logprobs)

    def __init__(self, runner, config: ModelConfig, engine: EngineConfig, out=None):
        self.inner, self.cfg, self.engine_cfg = runner, config, engine
        self.num_kv_blocks = runner.num_kv_blocks
        self.out, self.steps_left, self.step, self.count = out or sys.stderr, engine.trace_steps, 0, 0
        self.on_gpu = hasattr(runner, "arena")
        model = getattr(runner, "model", None)
        if not self.on_gpu and not hasattr(model, "observer"):
            raise TinyVLLMError(f"tracing needs the cuda or cpu runner, not {type(runner).__name__}")
        if self.on_gpu:
            self.names = PointerNames(runner, config)
            self._say("=== trace: memory (once per run) ===", runner.memory_report(),
                      "KV cache layout:", *kv_cache_lines(config, engine, runner.num_kv_blocks),
                      "weights:", *device_weight_lines(config))
        else:
            self.names = ArrayNames(model, runner.kv_cache, config)
            self._say("=== trace (--device cpu: the numpy twins that stand in for each kernel) ===",
                      "KV cache (numpy, float32):",
                      *kv_cache_lines(config, engine, runner.num_kv_blocks, itemsize=4),
                      "arena the cuda backend would allocate for this engine config (gpu/arena.py::ArenaLayout.plan):",
                      arena_layout(config, engine).memory_map())

    def __getattr__(self, name):              # memory_report, graphs, ...: the wrapped runner's
        return getattr(self.inner, name)

    def _say(self, *lines) -> None:
        print(*lines, sep="\n", file=self.out, flush=True)

    def execute(self, batch, sampling):
        if self.steps_left <= 0:
            return self.inner.execute(batch, sampling)
        self.steps_left -= 1
        self.step += 1
        self.count, self.layer = 0, None
        kind = "prefill" if batch.is_prefill else "decode"
        self._say(f"=== step {self.step}: {kind}, {batch.num_tokens} new tokens of {batch.num_seqs} sequences ===",
                  *batch_lines(batch))
        if self.on_gpu:
            ids = self._execute_gpu(batch, sampling)
        else:
            self.inner.model.observer = self._on_twin
            try:
                ids = self.inner.execute(batch, sampling)
            finally:
                self.inner.model.observer = None
            self._say(f"[{self.count + 1}] sample (reference/sampling.py::sample, twin of sampling.cu::sample_tokens): "
                      f"logits float32 ({batch.num_seqs}, {self.cfg.vocab_size}) -> token ids {_short(ids)}")
        if not self.steps_left:
            self._say(f"=== trace ends after {self.step} steps; later steps run untraced"
                      f"{' (decode steps replay CUDA graphs of exactly the launches above)' if self.on_gpu else ''} ===")
        return ids

    # -- GPU -----------------------------------------------------------------------------------
    def _execute_gpu(self, batch, sampling):
        r = self.inner
        sizes = sorted({size for size, _bank in getattr(r, "graphs", {})})     # keyed (size, input bank)
        size = next((s for s in sizes if s >= batch.num_seqs), None)
        if not batch.is_prefill and size is not None:
            self._say(f"  (run eagerly for the trace; untraced, this step replays the CUDA graph captured for "
                      f"{size} sequences: the same launches, the batch padded to {size} rows)")
        r.ops.observer, r.blas.observer = self._on_op, self._on_gemm
        try:
            ids = r.execute(batch, sampling, replay=False)
        finally:
            r.ops.observer = r.blas.observer = None
        self._say(f"  -> sampled token ids {_short(ids)}")
        return ids

    def _layer_header(self, labels) -> None:
        for label in labels:
            m = re.match(r"(?:layers\[|kv\.[kv]\()(\d+)", label)
            layer = int(m.group(1)) if m else ("head" if label in ("final_norm", "lm_head", "embed (= lm_head)") else None)
            if layer is not None and layer != self.layer and not (self.layer is None and layer == "head"):
                self.layer = layer
                self._say(f"  -- {'layer ' + str(layer) if layer != 'head' else 'final norm + LM head'} --")
                return

    def _on_op(self, op: str, repeat, details: dict) -> None:
        self.count += 1
        if "grid" in details:
            params = self.names.kernel_params(op)
            args = [self.names.argument(p, a) for p, a in zip(params, details["args"])]
            self._layer_header([a[1] for a in args if a[1]])
            shared = f" shared {details['shared_bytes']:,} B" if details["shared_bytes"] else ""
            self._say(f"[{self.count}] {op}  grid {details['grid']} block {details['block']}{shared}",
                      *(line for line, _ in args))
            return
        m, n, k, d = details["m"], details["n"], details["k"], details
        self.names.recent = {int(getattr(d[key], "data", d[key])): self.names.pointer(d[key]) for key in ("y", "x", "w")}
        w = self.names.pointer(d["w"])
        self._layer_header([w[1]])
        plus = "+" if d["accumulate"] else ""
        where = "gemv" if op.startswith("gemv") else "cuBLAS"
        self._say(f"[{self.count}] linear -> {where}:  Y[{m}, {n}] {plus}= X[{m}, {k}] @ W[{n}, {k}]^T"
                  f"   ({d['out_dtype']} out{', beta = 1: the residual add' if d['accumulate'] else ''})",
                  f"      y  W  {self.names.pointer(d['y'])[0]}", f"      x  R  {self.names.pointer(d['x'])[0]}",
                  f"      w  R  {w[0]}")
        if where == "gemv":
            grid, block, shared = self.inner.ops.gemv_launch_shape(n, k, last=d["last"])
            self._say(f"      kernel gemv_bf16  grid {grid} block {block} shared {shared:,} B")

    def _on_gemm(self, a: dict) -> None:
        name = lambda key: CUBLAS_NAMES[key].get(a[key], a[key])  # noqa: E731
        ptr = lambda key: (self.names.recent.get(a[key]) or self.names.pointer(a[key]))[1] or hex(a[key])  # noqa: E731
        self._say(f"      cublasGemmEx(transa={name('transa')}, transb={name('transb')}, m={a['m']}, n={a['n']}, "
                  f"k={a['k']}, alpha={a['alpha']}, A={ptr('A')} {name('Atype')} lda={a['lda']}, "
                  f"B={ptr('B')} {name('Btype')} ldb={a['ldb']}, beta={a['beta']}, C={ptr('C')} {name('Ctype')} "
                  f"ldc={a['ldc']}, {name('computeType')}, {name('algo')})",
                  f"      column-major C[{a['m']}x{a['n']}] = op(A)[{a['m']}x{a['k']}] . B[{a['k']}x{a['n']}]"
                  f"  ==  row-major Y[{a['n']}, {a['m']}] = X[{a['n']}, {a['k']}] @ W[{a['m']}, {a['k']}]^T")

    # -- CPU -----------------------------------------------------------------------------------
    def _on_twin(self, name: str, args, out) -> None:
        self.count += 1
        labels = [self.names.label(a) for a in args]
        self._layer_header([lab for lab in labels if lab])
        described = ", ".join(self.names.describe(a, lab) for a, lab in zip(args, labels))
        result = "in place" if out is None else f"{out.dtype} {out.shape}"
        residual = any(lab and lab.endswith((".o", ".down")) for lab in labels)
        self._say(f"[{self.count}] {name}({described}) -> {result}    twin of {TWIN_OF[name]}"
                  + ("; then hidden += it (fused on the GPU: beta = 1)" if residual else ""))

    def prompt_logits(self, token_ids):
        return self.inner.prompt_logits(token_ids)

    def close(self) -> None:
        self.inner.close()
