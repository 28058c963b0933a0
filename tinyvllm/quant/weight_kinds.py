"""The kinds of weight a loaded model may hold, and the few things the model does with any of them.

    np.ndarray        bf16 (or float32 / float16) as the checkpoint stored it
    Fp8Weight         e4m3 codes with float32 scales (fp8.py)
    QuantizedWeight   GGUF blocks (block_format.py)
    RowStack          matrices of different kinds stacked along rows: a fused q/k/v or gate/up
                      group whose parts a GGUF file stores in different formats (a Q4_K_M file
                      keeps attn_v in Q6_K beside Q4_K q and k)

linear() dispatches to each kind's twin (the GPU kernel it stands for): a float array as the
reference model's float32 matmul, the quantized kinds as fp8.linear / block_format.linear (a
RowStack's parts as block_format.linear_dequantized: its GEMV rounds each weight to bf16).
concat_rows() fuses a group into one weight; embedding_rows() reads only the looked-up rows of
an embedding table (a Q8_0 token_embd dequantizes 1 row per token, not the whole table).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.errors import ModelLoadError
from tinyvllm.quant import block_format, fp8
from tinyvllm.quant.block_format import BlockFormat, QuantizedWeight
from tinyvllm.quant.fp8 import Fp8Weight
from tinyvllm.quant.gguf_kquants import Q4_K, Q6_K
from tinyvllm.quant.gguf_legacy import Q4_0, Q4_1, Q8_0

# the quantized kinds (kind_name) the CUDA kernels read: cuda/gemv_quant.cu (and a RowStack of
# the GGUF ones, read as one matrix: gpu/quant_weights.py's EXPANDED)
GPU_KINDS = ("FP8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# the GGUF block types kept as blocks, by their GGUF type name
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)}


@dataclass(frozen=True, eq=False)          # arrays inside: compared by identity
class RowStack:
    """parts stacked along rows (all with the same column count): rows of part 0 first."""
    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def is_quantized(weight) -> bool:
    return not isinstance(weight, np.ndarray)


def linear(x: np.ndarray, weight) -> np.ndarray:
    """Y[m, n] = X[m, k] . W[n, k] in float32, W of any kind (each kind's twin)."""
    if isinstance(weight, QuantizedWeight):
        return block_format.linear(x, weight)
    if isinstance(weight, Fp8Weight):
        return fp8.linear(x, weight)
    if isinstance(weight, RowStack):    # the GPU's EXPANDED kind: each weight rounded to bf16
        return np.concatenate([block_format.linear_dequantized(x, part) for part in weight.parts], axis=1)
    return np.asarray(x, np.float32) @ np.asarray(weight, np.float32).T


def embedding_rows(table, ids: np.ndarray) -> np.ndarray:
    """float32 [len(ids), cols]: rows `ids` of an embedding table of any kind; a quantized table
    dequantizes only those rows (exactly, in float32: the value the GPU's residual stream gets
    before its own rounding)."""
    ids = np.asarray(ids, np.int64)
    if isinstance(table, QuantizedWeight):
        cols = table.shape[1]
        return table.format.dequantize(table.blocks[ids], (len(ids), cols))
    if isinstance(table, Fp8Weight):
        return table.codes[ids].astype(np.float32) * table.row_scales()[ids][:, None]
    if isinstance(table, RowStack):
        raise ModelLoadError("an embedding table cannot be a stack of parts")
    return np.asarray(table[ids], np.float32)


def concat_rows(parts: list, names: list[str]):
    """One weight for a fused group, parts stacked along rows in order: arrays concatenated;
    FP8 parts as one Fp8Weight with a scale per row (a per-tensor scale repeated over its part's
    rows); blocks of one format as one QuantizedWeight (a row's blocks are self-contained, so
    rows stack); any other mix of quantized kinds a RowStack. FP8 beside float parts is a
    ModelLoadError (the loader refuses it first, naming the checkpoint)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)
    if any(isinstance(p, Fp8Weight) for p in parts):
        if not all(isinstance(p, Fp8Weight) for p in parts):
            raise ModelLoadError(f"{', '.join(names)}: a fused group mixes FP8 and unquantized parts")
        return Fp8Weight(np.concatenate([p.codes for p in parts], axis=0),
                         np.concatenate([p.row_scales() for p in parts]).astype(np.float32))
    formats = {p.format.name if isinstance(p, QuantizedWeight) else None for p in parts}
    if len(formats) == 1 and None not in formats:
        rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
        return QuantizedWeight(parts[0].format, (rows, cols), np.concatenate([p.blocks for p in parts], axis=0))
    return RowStack(tuple(parts))


def kind_name(weight) -> str:
    """"BF16", "F32", "FP8", "Q4_1", ... (a RowStack: its parts' kinds joined by '+')."""
    if isinstance(weight, QuantizedWeight):
        return weight.format.name
    if isinstance(weight, Fp8Weight):
        return "FP8"
    if isinstance(weight, RowStack):
        return "+".join(kind_name(p) for p in weight.parts)
    return {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}.get(str(weight.dtype), str(weight.dtype))


def bytes_by_kind(weights: dict) -> dict[str, tuple[int, int]]:
    """kind -> (tensors, bytes) over a loaded weights dict (RowStack parts counted by kind)."""
    out: dict[str, tuple[int, int]] = {}
    for weight in weights.values():
        for part in weight.parts if isinstance(weight, RowStack) else (weight,):
            count, nbytes = out.get(kind_name(part), (0, 0))
            out[kind_name(part)] = (count + 1, nbytes + int(part.nbytes))
    return out


def quantization_summary(weights: dict) -> str | None:
    """"FP8 e4m3", "GGUF Q4_1 + Q8_0 blocks", ...: what quantized kinds the weights hold; None
    when every weight is a float array."""
    kinds = sorted({kind_name(p) for w in weights.values() if is_quantized(w)
                    for p in (w.parts if isinstance(w, RowStack) else (w,)) if is_quantized(p)})
    if not kinds:
        return None
    fp8_part = ["FP8 e4m3"] if "FP8" in kinds else []
    blocks = [k for k in kinds if k != "FP8"]
    return " + ".join(fp8_part + ([f"GGUF {' + '.join(blocks)} blocks"] if blocks else []))


def cuda_unsupported(weights: dict) -> str | None:
    """The quantized kinds of a loaded model the CUDA kernels do not read (a fused group mixing
    GGUF blocks with FP8 or float parts; a block format outside GPU_KINDS), None when there is
    none. A group of GGUF blocks in different formats is read (gpu/quant_weights.py's EXPANDED)."""
    kinds = set()
    for weight in weights.values():
        if isinstance(weight, RowStack):
            if not all(isinstance(p, QuantizedWeight) and kind_name(p) in GPU_KINDS for p in weight.parts):
                kinds.add(f"{kind_name(weight)} (a fused group mixing blocks with other kinds)")
        elif is_quantized(weight) and kind_name(weight) not in GPU_KINDS:
            kinds.add(kind_name(weight))
    return ", ".join(sorted(kinds)) or None
