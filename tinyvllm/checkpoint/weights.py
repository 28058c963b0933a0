"""Safetensors checkpoints: read them memory-mapped, write them (single file or sharded + index).

The format is small enough to own:

    [8 bytes: header length N, little-endian u64][N bytes: JSON header][tensor bytes ...]
    header = {"<name>": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]},
              "__metadata__": {"format": "pt"}}        # offsets count from the end of the header

Reading maps each file once and hands out numpy views over the map, so a bf16 checkpoint costs
no host RAM beyond the page cache; only fp16/fp32 tensors are converted (one copy per tensor).
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from tinyvllm.checkpoint.weight_names import expected_shapes, stored_names
from tinyvllm.config import ModelConfig
from tinyvllm.errors import ModelLoadError
from tinyvllm.quant.quant_config import UNQUANTIZED

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
FLOAT_DTYPES = ("BF16", "F16", "F32")
BF16 = np.dtype(ml_dtypes.bfloat16)
MAX_HEADER_BYTES = 100_000_000      # the safetensors format's own limit; read before anything else
MAX_DIMS = 8


# ---- reading ------------------------------------------------------------------------------

@dataclass
class SafetensorsFile:
    """One mapped .safetensors file: its header entries and zero-copy access to its tensors."""
    path: Path
    entries: dict[str, dict]
    metadata: dict[str, str]
    _map: mmap.mmap | None
    _data_start: int

    @classmethod
    def open(cls, path: Path) -> SafetensorsFile:
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                if size < 8:
                    raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
                f.seek(0)
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    raise ModelLoadError(f"{path}: corrupt safetensors header (header length "
                                         f"{header_len}; the file has {size} bytes and headers "
                                         f"are at most {MAX_HEADER_BYTES})")
                header = _parse_header(f.read(header_len), path)
                data_start = 8 + header_len
                data_size = size - data_start
                # mmap of an empty region is an error; a file with only empty tensors needs none
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if data_size else None
        except OSError as e:
            raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ModelLoadError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
        for name, entry in header.items():
            _check_entry(name, entry, data_size, path)
        return cls(path, header, metadata, mapped, data_start)

    def get(self, name: str) -> np.ndarray:
        """Read-only array viewing the mapped bytes of one tensor (no copy)."""
        entry = self.entries[name]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end == begin:
            return np.zeros(shape, dtype)
        flat = np.frombuffer(self._map, dtype, count=(end - begin) // dtype.itemsize,
                             offset=self._data_start + begin)
        return flat.reshape(shape)


def _parse_header(raw: bytes, path: Path) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: corrupt safetensors header (nested too deeply)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header


def _check_entry(name: str, entry, data_size: int, path: Path) -> None:
    """Every field of a header entry, with Python integers (no int64 wrap-around): a crafted
    shape must not make get() allocate or view more bytes than the file holds."""
    def bad(why):
        return ModelLoadError(f"{path}: tensor {name!r}: {why}")

    def non_negative_ints(values, count=None) -> bool:
        return (isinstance(values, list) and (count is None or len(values) == count)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values))

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad("header entry lacks dtype/shape/data_offsets")
    if not isinstance(entry["dtype"], str) or entry["dtype"] not in DTYPES:
        raise bad(f"unsupported dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not non_negative_ints(shape) or len(shape) > MAX_DIMS:
        raise bad(f"malformed shape {shape!r} (a list of at most {MAX_DIMS} non-negative integers)")
    if not non_negative_ints(offsets, 2):
        raise bad(f"malformed data_offsets {offsets!r} (two non-negative integers)")
    begin, end = offsets
    need = math.prod(shape) * DTYPES[entry["dtype"]].itemsize
    if begin > end or end - begin != need:
        raise bad(f"data_offsets {offsets} do not match shape {shape}")
    if end > data_size:
        raise bad(f"data ends at byte {end} but the file holds only {data_size} data bytes "
                  "(truncated file?)")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the file holding it, from the shard index, model.safetensors, or (no index)
    every *.safetensors in the directory."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: invalid shard index ({e!r})") from None
        return {name: model_dir / file for name, file in weight_map.items()}
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() \
        else sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pth")]
        hint = f" (found {', '.join(other)}: convert to safetensors)" if other else ""
        raise ModelLoadError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return {name: path for path in files for name in SafetensorsFile.open(path).entries}


class CheckpointReader:
    """A checkpoint directory's tensors by name; each file is mapped once, when first needed."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"model directory not found: {self.model_dir}")
        files = checkpoint_files(self.model_dir)
        self.stored = stored_names(files)           # a multimodal model's text tensors by their own names
        self.where = {name: files[stored] for name, stored in self.stored.items()}
        self._opened: dict[Path, SafetensorsFile] = {}

    def entry(self, name: str) -> tuple[SafetensorsFile, dict]:
        """The file holding `name` and its header entry; a tensor missing is a ModelLoadError."""
        if name not in self.where:
            raise ModelLoadError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
        path = self.where[name]
        if path not in self._opened:
            if not path.is_file():
                raise ModelLoadError(f"{self.model_dir}: shard {path.name} (holding {name!r}) is missing")
            self._opened[path] = SafetensorsFile.open(path)
        f, stored = self._opened[path], self.stored[name]
        if stored not in f.entries:
            raise ModelLoadError(f"{path}: the index says it holds {stored!r}, but it does not")
        return f, f.entries[stored]

    def get(self, name: str, shape: tuple[int, ...] | None = None,
            dtypes: tuple[str, ...] = FLOAT_DTYPES, why: str = "") -> np.ndarray:
        """The tensor as stored (a view of the map), its shape and dtype checked."""
        f, entry = self.entry(name)
        if shape is not None and tuple(entry["shape"]) != shape:
            raise ModelLoadError(f"{f.path}: tensor {name!r} has shape {tuple(entry['shape'])}, "
                                 f"config.json implies {shape}")
        if entry["dtype"] not in dtypes:
            raise ModelLoadError(f"{f.path}: tensor {name!r} has dtype {entry['dtype']}; expected one "
                                 f"of {', '.join(dtypes)}{why}")
        return f.get(self.stored[name])

    def get_bf16(self, name: str, shape: tuple[int, ...] | None = None, why: str = "") -> np.ndarray:
        """get(), as bf16: a view over the file where it is stored so, else converted."""
        return as_bf16(self.get(name, shape, why=why))


def load_weights(model_dir: str | Path, config: ModelConfig,
                 quantization: str | None = None) -> dict[str, np.ndarray]:
    """Exactly the tensors of expected_shapes(config), as bf16 arrays. bf16 tensors are views
    over the memory-mapped files; fp16/fp32 ones are converted. Tensors the model does not use
    (rotary inv_freq, lm_head of a tied model) are ignored. A checkpoint whose config.json
    declares FP8 weights, or `quantization="fp8"` (EngineConfig.quantization), gives Fp8Weight
    for the quantized linears (checkpoint/fp8_weights.py)."""
    reader = CheckpointReader(model_dir)
    if config.quantization is not None or quantization is not None:
        from tinyvllm.checkpoint.fp8_weights import load_fp8_weights
        return load_fp8_weights(reader, config, quantization)
    return {name: as_bf16(reader.get(name, shape, why=UNQUANTIZED))
            for name, shape in expected_shapes(config).items()}


def as_bf16(array: np.ndarray) -> np.ndarray:
    return array if array.dtype == BF16 else array.astype(BF16)


# ---- writing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its bytes are produced only when its turn comes."""
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def write_safetensors(path: str | Path, specs: list[TensorSpec],
                      make: Callable[[TensorSpec], np.ndarray], metadata: dict | None = None) -> None:
    """Write one file, calling make(spec) for each tensor in turn, so that at most one tensor's
    bytes are alive at a time (the 8B embedding is 1 GB; the model is 16 GB)."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}}
    offset = 0
    for s in specs:
        if np.dtype(s.dtype) not in DTYPE_NAMES:
            raise ValueError(f"{s.name}: dtype {s.dtype} cannot be stored in safetensors")
        header[s.name] = {"dtype": DTYPE_NAMES[np.dtype(s.dtype)], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)          # keeps every tensor 8-byte aligned in the map
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            array = np.ascontiguousarray(make(s))
            if array.shape != tuple(s.shape) or array.dtype != np.dtype(s.dtype):
                raise ValueError(f"{s.name}: produced {array.dtype}{array.shape}, "
                                 f"declared {np.dtype(s.dtype)}{tuple(s.shape)}")
            f.write(array.reshape(-1).view(np.uint8).data)


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write a dict of arrays to one .safetensors file."""
    specs = [TensorSpec(n, tuple(a.shape), a.dtype) for n, a in tensors.items()]
    write_safetensors(path, specs, lambda s: tensors[s.name], metadata)


def shard_plan(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Fill shards in order, starting a new one when the next tensor would overflow the limit
    (a single tensor larger than the limit gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def write_checkpoint(model_dir: str | Path, specs: list[TensorSpec],
                     make: Callable[[TensorSpec], np.ndarray], max_shard_bytes: int) -> list[Path]:
    """Write model.safetensors, or, above max_shard_bytes, model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json, as Hugging Face lays them out. -> the files written."""
    model_dir = Path(model_dir)
    shards = shard_plan(specs, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(model_dir / SINGLE_FILE, shards[0], make)
        return [model_dir / SINGLE_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = model_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path, shard, make)
        paths.append(path)
        weight_map.update({s.name: path.name for s in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def save_sharded(model_dir: str | Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[Path]:
    """write_checkpoint for a dict of arrays already in memory."""
    specs = [TensorSpec(n, tuple(a.shape), a.dtype) for n, a in tensors.items()]
    return write_checkpoint(model_dir, specs, lambda s: tensors[s.name], max_shard_bytes)
