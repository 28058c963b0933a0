"""FP8 checkpoints' tensors: a safetensors file that holds F8_E4M3 weights, and the pairing of each
quantized linear's `weight` with its `weight_scale`.

What such a checkpoint stores for a quantized linear layer M (vLLM's "fp8" serialisation and
compressed-tensors' float-quantized format alike):
    M.weight        F8_E4M3  [rows, cols]    one e4m3 code per weight (fp8.py's layout)
    M.weight_scale  F32 (or BF16 / F16)      [] or [1]: per tensor;  [rows] or [rows, 1]: per channel
    M.input_scale   present only with static activation scales, which are refused
W[r, c] ~ weight[r, c] * scale[r] (or the one scale). Other tensors (embedding, norms, ignored
linears) are ordinary float tensors.

read_safetensors reads a file as checkpoint/weights.py's reader does (header length, JSON header,
every entry checked against the file's size, zero-copy views over a read-only map) with the
F8_E4M3 dtype added to its table.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.weights import DTYPES, MAX_HEADER_BYTES
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.fp8 import E4M3, Fp8Weight
from tinyvllm.quant.quant_config import QuantConfig

FP8_DTYPE = "F8_E4M3"
TENSOR_DTYPES = {**DTYPES, FP8_DTYPE: E4M3}
SCALE_DTYPES = ("F32", "BF16", "F16")
WEIGHT, SCALE, INPUT_SCALE = ".weight", ".weight_scale", ".input_scale"


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """-> ({name: read-only array over the mapped file}, {name: safetensors dtype name})."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise ModelLoadError(f"{path}: truncated or corrupt safetensors header")
            header = json.loads(f.read(header_len).decode("utf-8"))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    start, tensors, dtypes = 8 + header_len, {}, {}
    for name, entry in header.items():
        dtype_name, shape, (begin, end) = _checked_entry(name, entry, size - start, path)
        dtype = TENSOR_DTYPES[dtype_name]
        tensors[name] = (np.zeros(shape, dtype) if end == begin else
                         np.frombuffer(mapped, dtype, (end - begin) // dtype.itemsize, start + begin).reshape(shape))
        dtypes[name] = dtype_name
    return tensors, dtypes


def _checked_entry(name: str, entry, data_size: int, path: Path):
    def valid_ints(values, count=None):
        return (isinstance(values, list) and (count is None or len(values) == count)
                and all(type(v) is int and v >= 0 for v in values))

    if not isinstance(entry, dict) or entry.get("dtype") not in TENSOR_DTYPES:
        raise ModelLoadError(f"{path}: tensor {name!r}: unsupported or missing dtype "
                             f"{entry.get('dtype') if isinstance(entry, dict) else entry!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not valid_ints(shape) or not valid_ints(offsets, 2):
        raise ModelLoadError(f"{path}: tensor {name!r}: malformed shape or data_offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * TENSOR_DTYPES[entry["dtype"]].itemsize or end > data_size:
        raise ModelLoadError(f"{path}: tensor {name!r}: data_offsets {offsets} do not match shape "
                             f"{shape} within the file's {data_size} data bytes")
    return entry["dtype"], tuple(shape), offsets


def fp8_weight(codes: np.ndarray, scale: np.ndarray, name: str, strategy: str | None,
               source: str) -> Fp8Weight:
    """One checkpoint weight (e4m3 [rows, cols]) and its weight_scale -> Fp8Weight. The scale's
    shape says per tensor ([] or [1]) or per channel ([rows] or [rows, 1]); `strategy` ("tensor",
    "channel", None: either) is what quantization_config declared."""
    if codes.dtype != E4M3 or codes.ndim != 2:
        raise ModelLoadError(f"{source}: {name}{WEIGHT} is {codes.dtype}{list(codes.shape)}; "
                             "a quantized linear's weight is a float8_e4m3fn matrix")
    rows = codes.shape[0]
    found = "tensor" if scale.size == 1 and scale.ndim <= 1 else \
        "channel" if scale.shape in ((rows,), (rows, 1)) else None
    if found is None or (strategy is not None and found != strategy):
        expected = {"tensor": "[] or [1]", "channel": f"[{rows}] or [{rows}, 1]",
                    None: f"[], [1], [{rows}] or [{rows}, 1]"}[strategy]
        raise ModelLoadError(f"{source}: {name}{SCALE} has shape {list(scale.shape)}; expected "
                             f"{expected} for a {rows}-row weight")
    scale32 = scale.astype(np.float32)
    if not np.isfinite(scale32).all():
        raise ModelLoadError(f"{source}: {name}{SCALE} holds a non-finite value")
    return Fp8Weight(codes, scale32.reshape(() if found == "tensor" else (rows,)))


def fp8_linears(tensors: dict[str, np.ndarray], dtypes: dict[str, str], qconfig: QuantConfig,
                source: str) -> dict[str, Fp8Weight | np.ndarray]:
    """The tensors of an FP8 checkpoint with each quantized linear's `M.weight` and
    `M.weight_scale` replaced by one Fp8Weight under `M.weight`. An F8_E4M3 weight without its
    scale, a scale without its weight, an F8_E4M3 weight of a module the config ignores, and an
    input_scale (static activation scales) are each a ModelLoadError naming the tensor."""
    out: dict[str, Fp8Weight | np.ndarray] = {}
    for name, array in tensors.items():
        if name.endswith(INPUT_SCALE):
            raise ModelLoadError(f"{source}: {name}: static activation scales are not supported "
                                 "(quantize the activations dynamically)")
        if name.endswith(SCALE):
            if dtypes.get(name[:-len(SCALE)] + WEIGHT) != FP8_DTYPE:
                raise ModelLoadError(f"{source}: {name} has no F8_E4M3 weight beside it")
            if dtypes[name] not in SCALE_DTYPES:
                raise ModelLoadError(f"{source}: {name} is {dtypes[name]}; expected one of {', '.join(SCALE_DTYPES)}")
            continue
        if dtypes[name] != FP8_DTYPE:
            out[name] = array
            continue
        module = name[:-len(WEIGHT)] if name.endswith(WEIGHT) else name
        if not name.endswith(WEIGHT) or not qconfig.quantizes(module):
            raise ModelLoadError(f"{source}: {name} is F8_E4M3 but quantization_config does not "
                                 "quantize it")
        if module + SCALE not in tensors:
            raise ModelLoadError(f"{source}: {name} is F8_E4M3 but {module}{SCALE} is missing")
        out[name] = fp8_weight(array, tensors[module + SCALE], module, qconfig.weight_strategy, source)
    return out
