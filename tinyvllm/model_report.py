"""`python -m tinyvllm inspect`: what a model is and what serving it costs, without a GPU.

The model's config and parameter count, every checkpoint tensor (name, dtype, shape, bytes, from
the safetensors headers or a GGUF file's tensor table), the weights as loaded by kind (quantized
ones at their own bytes: FP8 codes and scales, GGUF blocks), the fused tensors the GPU backend uploads, KV-cache memory at the
engine's context limit, and the buffer arena planned for the engine's batch limits: all pure
Python over the same functions the engine itself uses (gpu/arena.py plans without allocating).
The trace (tinyvllm/trace.py) prints the KV layout and arena map from here too.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.gpu.arena import ArenaDims, ArenaLayout, round_up
from tinyvllm.gpu.device_weights import (
    device_host_tensors,
    device_tensor_itemsize,
    device_tensor_shapes,
    device_weight_bytes,
)


def _gib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.3f} GiB)" if n >= 2**26 else f"{n:,} bytes ({n / 2**20:.2f} MiB)"


def config_lines(config: ModelConfig) -> list[str]:
    return [f"  {k:<26}{v}" for k, v in dataclasses.asdict(config).items()]


def checkpoint_tensor_lines(model_dir: Path) -> list[str]:
    """One line per tensor of the checkpoint, in file order, from the safetensors headers; a
    tensor the engine does not read (a multimodal model's vision tower) is marked so."""
    from tinyvllm.checkpoint.weight_names import stored_names
    from tinyvllm.checkpoint.weights import SafetensorsFile, checkpoint_files
    where = checkpoint_files(model_dir)
    files, read = sorted(set(where.values())), set(stored_names(where).values())
    width = max([len("tensor"), *map(len, where)]) + 2
    lines, total = [f"  {'tensor':<{width}}{'dtype':<8}{'shape':<16}{'bytes':>14}"], 0
    for path in files:
        entries = SafetensorsFile.open(path).entries
        for name, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            nbytes = e["data_offsets"][1] - e["data_offsets"][0]
            total += nbytes
            unread = "" if name in read else "  (not read)"
            lines.append(f"  {name:<{width}}{e['dtype']:<8}{str(tuple(e['shape'])):<16}{nbytes:>14,}{unread}")
        lines.append(f"  -- {path.name}: {len(entries)} tensors")
    lines.append(f"  checkpoint tensors: {_gib(total)}")
    return lines


def device_weight_lines(config: ModelConfig) -> list[str]:
    """The fused tensors as gpu/device_weights.py uploads them, with their offsets in the one
    weights allocation (the trace names pointers by these)."""
    lines, offset = [f"  {'device tensor':<24}{'offset':>14}  {'shape':<16}{'dtype':<10}{'bytes':>14}"], 0
    for key, shape in device_tensor_shapes(config).items():
        size = device_tensor_itemsize(key)
        nbytes = int(np.prod(shape)) * size
        lines.append(f"  {weight_label(key):<24}{offset:>14,}  {str(shape):<16}"
                     f"{'float32' if size == 4 else 'bfloat16':<10}{nbytes:>14,}")
        offset += round_up(nbytes)
    tied = " (lm_head is the embedding table: tied)" if config.tie_word_embeddings else ""
    lines.append(f"  weights allocation: {_gib(device_weight_bytes(config))}{tied}")
    return lines


def quantized_device_weight_lines(tensors: dict) -> list[str]:
    """device_weight_lines for a quantized model from its upload plan (device_host_tensors): each
    tensor's kind and device bytes (quantized matrices as their planes, gpu/quant_weights.py)."""
    lines = [f"  {'device tensor':<24}{'kind':<10}{'bytes':>14}"]
    for key, t in tensors.items():
        kind = t.kind or ("reserved" if t.reserve else str(t.arrays[0].dtype))
        lines.append(f"  {weight_label(key) if key != 'dequant_scratch' else key:<24}{kind:<10}{t.nbytes:>14,}")
    lines.append(f"  weights allocation: {_gib(sum(t.nbytes for t in tensors.values()))}")
    return lines


def weight_label(key: str) -> str:
    """device_tensor_shapes key -> the name DeviceWeights gives it ("3.qkv" -> "layers[3].qkv")."""
    layer, dot, part = key.partition(".")
    return f"layers[{layer}].{part}" if dot else key


def kv_cache_lines(config: ModelConfig, engine: EngineConfig, num_blocks: int | None = None,
                   itemsize: int = 2) -> list[str]:
    """The paged KV cache's layout and what it costs per token, block and full sequence."""
    c, bs = config, engine.block_size
    per_token = c.num_hidden_layers * 2 * c.kv_size * itemsize
    limit = engine.context_limit(config)
    dtype = "bf16" if itemsize == 2 else "float32"
    lines = [
        f"  layout [layers {c.num_hidden_layers}, K/V 2, blocks, block_size {bs}, kv_heads "
        f"{c.num_key_value_heads}, head_dim {c.head_dim}] {dtype}",
        f"  per layer K (and V): [blocks * {bs} slots, {c.num_key_value_heads}, {c.head_dim}], "
        f"slot = block_tables[seq, pos // {bs}] * {bs} + pos % {bs}",
        f"  per token {per_token:,} bytes (= layers {c.num_hidden_layers} x 2 x kv_heads "
        f"{c.num_key_value_heads} x head_dim {c.head_dim} x {itemsize}); per block {per_token * bs:,}",
        f"  one sequence at the context limit {limit:,}: {_gib(per_token * limit)}; "
        f"{engine.max_num_seqs} of them: {_gib(per_token * limit * engine.max_num_seqs)}",
    ]
    if num_blocks is not None:
        lines.append(f"  allocated: {num_blocks:,} blocks = {num_blocks * bs:,} token slots = "
                     f"{_gib(num_blocks * bs * per_token)}")
    return lines


def arena_layout(config: ModelConfig, engine: EngineConfig) -> ArenaLayout:
    return ArenaLayout.plan(ArenaDims.from_configs(config, engine))


def gguf_tensor_lines(gguf_file: Path) -> list[str]:
    """One line per tensor of a GGUF file, in file order, from its tensor table."""
    from tinyvllm.checkpoint.gguf_header import open_gguf
    lines, total = [f"  {'tensor':<48}{'type':<8}{'shape':<16}{'bytes':>14}"], 0
    for t in open_gguf(gguf_file).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        total += int(t.n_bytes)
        lines.append(f"  {t.name:<48}{t.tensor_type.name:<8}{str(shape):<16}{int(t.n_bytes):>14,}")
    lines.append(f"  GGUF tensors: {_gib(total)}")
    return lines


def loaded_weight_lines(weights: dict, config: ModelConfig) -> list[str]:
    """The weights as the engine holds them, by kind: quantized weights count their own bytes
    (codes and scales, or blocks), float arrays theirs."""
    from tinyvllm.quant.weight_kinds import bytes_by_kind
    kinds = bytes_by_kind(weights)
    lines = [f"  {'kind':<12}{'tensors':>8}{'bytes':>16}"]
    lines += [f"  {kind:<12}{count:>8}{nbytes:>16,}" for kind, (count, nbytes) in sorted(kinds.items())]
    total = sum(nbytes for _, nbytes in kinds.values())
    lines.append(f"  total {_gib(total)}: {8 * total / config.num_parameters:.2f} bits per parameter "
                 f"(bf16: {_gib(2 * config.num_parameters)})")
    return lines


def tensor_parallel_lines(config: ModelConfig, engine: EngineConfig) -> list[str]:
    """Each rank's share of the weights and KV cache (bf16) when the engine splits the model."""
    if (engine.tensor_parallel_size or 1) == 1:
        return []
    from tinyvllm.parallel.sharding import rank_memory_lines
    return ["tensor parallel (tinyvllm/parallel/sharding.py; bf16 as on the GPU):",
            *rank_memory_lines(config, engine.tensor_parallel_size), ""]


def inspect_report(model: str | Path, engine: EngineConfig) -> str:
    from tinyvllm.checkpoint.loading import cuda_refuses, read_weights, resolve_checkpoint
    from tinyvllm.quant.weight_kinds import cuda_unsupported, quantization_summary
    model_dir, gguf_file = resolve_checkpoint(model, engine)
    config = ModelConfig.from_pretrained(model_dir)
    loaded = read_weights(model_dir, gguf_file, config, engine)
    quantized = quantization_summary(loaded)
    layout = arena_layout(config, engine)
    unsupported = cuda_unsupported(loaded)
    # a quantized model's upload plan (its planes packed once): its tensor lines and its bytes
    plan = device_host_tensors(config, loaded) if quantized and not unsupported else None
    weights = sum(t.nbytes for t in plan.values()) if plan else device_weight_bytes(config)
    kv_full = config.kv_bytes_per_token * engine.context_limit(config) * engine.max_num_seqs
    tensors = (["GGUF tensors (the file's tensor table):", *gguf_tensor_lines(gguf_file)] if gguf_file else
               ["checkpoint tensors (safetensors headers):", *checkpoint_tensor_lines(model_dir)])
    device = ([f"  {cuda_refuses(unsupported)}; in bf16 the upload would be:", *device_weight_lines(config)]
              if unsupported else quantized_device_weight_lines(plan) if plan else device_weight_lines(config))
    return "\n".join([
        f"model {model}", "config:", *config_lines(config),
        f"parameters: {config.num_parameters:,}", "", *tensors, "",
        f"weights as loaded{f' ({quantized})' if quantized else ''}:", *loaded_weight_lines(loaded, config), "",
        "device weights (q/k/v and gate/up fused, as uploaded to the GPU):", *device, "",
        "KV cache:", *kv_cache_lines(config, engine), "",
        f"arena for max_num_seqs={engine.max_num_seqs}, max_num_batched_tokens={engine.max_num_batched_tokens}, "
        f"context limit {engine.context_limit(config):,}:", layout.memory_map(), "",
        *tensor_parallel_lines(config, engine),
        f"GPU memory: weights {_gib(weights)} + arena {_gib(layout.total_bytes)} + KV for "
        f"{engine.max_num_seqs} full contexts {_gib(kv_full)} = {_gib(weights + layout.total_bytes + kv_full)} "
        f"(the engine sizes the KV cache from free memory instead: gpu/kv_cache.py::num_blocks_to_allocate)",
    ])
