"""Opening a GGUF file safely: its header (metadata and tensor table) is walked with every count,
length and offset checked against the file's size and sane bounds before the `gguf` package's
reader allocates anything on the file's say-so, so that a truncated, corrupt or crafted file is
one ModelLoadError naming the problem.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path

from tinyvllm.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over the file, every tensor checked to lie inside it. A file that is
    not GGUF, is truncated or has a corrupt header is one ModelLoadError."""
    import gguf
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = f.seek(0, 2)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    check_header(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 — the parser's errors on a damaged header are bare
        # ValueError/IndexError/... from numpy; any of them means the same thing here
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"{path}: tensor {t.name!r} ends at byte {end} but the file has "
                                 f"{size} bytes (truncated file?)")
    return reader


# Bounds of the header check: far above any real Llama file (vocabularies of ~256k tokens,
# ~500k merges, ~300 tensors, chat templates of tens of KB), far below a harmful allocation.
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 24
MAX_STRING_BYTES = 1 << 24
MAX_TENSOR_DIMS = 4              # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 2
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # type -> bytes
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    """Reads a GGUF header from a mapped file, every length checked against the bytes that are
    left before anything is read or allocated for it."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos, self.end = data, path, 0, len(data)
        self.order = "<"

    def fail(self, why: str):
        raise ModelLoadError(f"{self.path}: corrupt GGUF header: {why} (at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        if n > self.end - self.pos:
            self.fail(f"{what} needs {n} bytes but only {self.end - self.pos} are left (truncated file?)")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(self.data[start:start + size], "little" if self.order == "<" else "big")

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> bytes:
        n = self.uint(8, f"the length of {what}")
        if n > limit:
            self.fail(f"{what} is {n} bytes long (at most {limit})")
        start = self.take(n, what)
        return bytes(self.data[start:start + n])

    def value(self, type_: int, what: str, nesting: int = 0) -> None:
        if type_ in _SCALARS:
            self.take(_SCALARS[type_], what)
        elif type_ == _STRING:
            self.string(what)
        elif type_ == _ARRAY:
            if nesting >= MAX_ARRAY_NESTING:
                self.fail(f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep")
            item = self.uint(4, f"the item type of {what}")
            count = self.uint(8, f"the length of {what}")
            smallest = _SCALARS.get(item, 8 if item == _STRING else 12 if item == _ARRAY else None)
            if smallest is None:
                self.fail(f"{what}: unknown item type {item}")
            if count > MAX_ARRAY_ITEMS or count * smallest > self.end - self.pos:
                self.fail(f"{what} claims {count} items: more than "
                          f"{'the file holds' if count <= MAX_ARRAY_ITEMS else MAX_ARRAY_ITEMS}")
            if item in _SCALARS:
                self.take(count * _SCALARS[item], what)
            elif item == _STRING:               # vocabularies: the one long loop, kept tight
                self._strings(count, what)
            else:
                for _ in range(count):
                    self.value(item, what, nesting + 1)
        else:
            self.fail(f"{what}: unknown value type {type_}")

    def _strings(self, count: int, what: str) -> None:
        unpack, data, pos, end = struct.Struct(self.order + "Q").unpack_from, self.data, self.pos, self.end
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(data, pos)
            pos += 8 + n
            if n > MAX_STRING_BYTES or pos > end:
                break
        else:
            self.pos = pos
            return
        self.pos = pos
        self.fail(f"a string of {what} runs past the end of the file")


def check_header(path: Path) -> None:
    """Walk the GGUF header (metadata and tensor table) with every count, length and offset
    checked against the file's size and sane bounds, so that a crafted file is one clear
    ModelLoadError before gguf's reader allocates anything on its say-so."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ModelLoadError(f"{path}: truncated GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            r = _HeaderReader(data, path)
            r.take(4, "the magic")
            version = r.uint(4, "the version")
            if version not in (2, 3):
                r.order = ">"                       # a big-endian file reads its version swapped
                r.pos = 4
                version = r.uint(4, "the version")
                if version not in (2, 3):
                    r.fail(f"unsupported GGUF version {version} (2 and 3 are read)")
            n_tensors, n_keys = r.uint(8, "the tensor count"), r.uint(8, "the key count")
            left = size - r.pos
            # each key is at least 8 + 4 + 1 bytes; each tensor entry at least 8 + 4 + 4 + 8
            for count, what, most, smallest in ((n_keys, "metadata keys", MAX_KEYS, 13),
                                                 (n_tensors, "tensors", MAX_TENSORS, 24)):
                if count > most:
                    r.fail(f"the header claims {count} {what} (at most {most})")
                if count * smallest > left:
                    r.fail(f"the header claims {count} {what}: more than the {left} bytes left "
                           "can hold (truncated file?)")
            alignment = 32
            for _ in range(n_keys):
                key = r.string("a metadata key", 1 << 16).decode("utf-8", "replace")
                type_ = r.uint(4, f"the type of {key!r}")
                if key == "general.alignment" and type_ == 4:
                    alignment = r.uint(4, key)
                    if alignment == 0 or alignment & (alignment - 1):
                        r.fail(f"general.alignment {alignment} is not a power of two")
                else:
                    r.value(type_, f"metadata {key!r}")
            tensors = []
            for _ in range(n_tensors):
                name = r.string("a tensor name", 1 << 16).decode("utf-8", "replace")
                n_dims = r.uint(4, f"the dimension count of {name!r}")
                if not 1 <= n_dims <= MAX_TENSOR_DIMS:
                    r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS})")
                dims = [r.uint(8, f"a dimension of {name!r}") for _ in range(n_dims)]
                ggml_type = r.uint(4, f"the type of {name!r}")
                offset = r.uint(8, f"the data offset of {name!r}")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
                except (ValueError, KeyError):
                    r.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
                elements = math.prod(dims)
                if elements % block:
                    r.fail(f"tensor {name!r}: {elements} elements are not whole blocks of {block}")
                tensors.append((name, offset, elements // block * block_bytes))
            data_start = -(-r.pos // alignment) * alignment
            for name, offset, nbytes in tensors:
                if data_start + offset + nbytes > size:
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} ends at byte {data_start + offset + nbytes} but the "
                        f"file has {size} bytes (truncated file?)")
