"""The GGUF container: metadata, tensor table and dequantized tensor data of one file.

Architecture-agnostic; `gguf_loader.py` hands what this reads to the architecture's reader.

Why not `gguf.GGUFReader`: it builds a numpy view per metadata element, which takes 4-5 s on
a 49k-token vocabulary (2 cores). Parsing the header with `struct` over an `mmap` takes ~0.1 s.
The layout follows https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2 and v3,
little-endian). Dequantization is `gguf.quants.dequantize`.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted with 32-bit ints; nothing current writes it
DEFAULT_ALIGNMENT = 32  # when `general.alignment` is absent

# Storage types this reader dequantizes (all go through `gguf.quants.dequantize`).
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    getattr(GGMLQuantizationType, name)
    for name in (
        "F32", "F16", "BF16",
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
        "MXFP4",  # GPT-OSS experts; every value is a power of two times a 4-bit float, exact in float32
    )
    if hasattr(GGMLQuantizationType, name)
)  # fmt: skip

# Metadata value type id -> (struct format, numpy dtype). 8 = string and 9 = array are not fixed-size.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class _Corrupt(Exception):
    """Raised inside the parser; `open_gguf` turns it into a ValueError naming the file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores ne[0], the fastest-moving dim, first)
    tensor_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file. Tensor data stays memory-mapped until `read_tensor` asks for it."""

    path: str
    metadata: dict[str, Any]  # numeric arrays are np.ndarray, string arrays list[str]
    tensors: dict[str, TensorInfo]  # in file order
    _buffer: mmap.mmap = field(repr=False, compare=False)

    def read_blocks(self, name: str) -> np.ndarray:
        """One tensor's stored bytes as uint8 [rows, bytes per row]: a read-only view of the
        memory map (quantized blocks as they are; `TensorInfo.tensor_type` says how to read
        them). Copy what must outlive the file."""
        info = self.tensors[name]
        raw = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(math.prod(info.shape[:-1]), -1)

    def read_tensor(self, name: str) -> np.ndarray:
        """Dequantize one tensor to a fresh, writable float32 array of `TensorInfo.shape`."""
        info = self.tensors[name]
        values = dequantize(self.read_blocks(name), info.tensor_type)  # [rows, shape[-1]]
        if not values.flags.writeable or values.dtype != np.float32:  # F32 is a view of the map
            values = values.astype(np.float32, copy=True)
        return values.reshape(info.shape)


def open_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header and check every tensor is in range and of a supported type.

    Raises FileNotFoundError if `path` does not exist, ValueError if it is not a GGUF file, is
    truncated or corrupt, or stores a tensor type this reader cannot dequantize.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(
                f"{path} is not a GGUF file: it starts with {magic!r}, GGUF files start with {GGUF_MAGIC!r}."
            )
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors = _parse(buffer, size, path)
    except (_Corrupt, struct.error, UnicodeDecodeError, OverflowError) as exc:
        buffer.close()
        raise ValueError(f"{path} is truncated or corrupt: {exc}") from exc
    except ValueError:  # already a clear message: big-endian file, unsupported tensor type
        buffer.close()
        raise
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, _buffer=buffer)


def _parse(buf: mmap.mmap, size: int, path: str) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version & 0xFFFF == 0 and version != 0:
        raise ValueError(f"{path} is a big-endian GGUF file; only little-endian files are supported.")
    if version not in SUPPORTED_VERSIONS:
        raise _Corrupt(f"GGUF version {version}, expected one of {SUPPORTED_VERSIONS}")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(_checked_count(kv_count, 8 + 4, pos, size, "metadata entries")):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type, size)

    raw_tensors = []
    for _ in range(_checked_count(tensor_count, 8 + 4 + 4 + 8, pos, size, "tensors")):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if n_dims > 8:
            raise _Corrupt(f"tensor {name!r} claims {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        type_id, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        raw_tensors.append((name, tuple(reversed(dims)), type_id, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment={alignment!r} is not a power of two")
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in raw_tensors:
        info = _tensor_info(name, shape, type_id, data_start + offset, path)
        if info.offset + info.nbytes > size:
            raise _Corrupt(
                f"tensor {name!r} ends at byte {info.offset + info.nbytes} but the file has {size} bytes"
            )
        tensors[name] = info
    return metadata, tensors


def _tensor_info(name: str, shape: tuple[int, ...], type_id: int, offset: int, path: str) -> TensorInfo:
    try:
        tensor_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise _Corrupt(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    if tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ValueError(
            f"{path}: tensor {name!r} is stored as {tensor_type.name}, which this reader cannot "
            f"dequantize. Supported types: {supported}."
        )
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    elements = math.prod(shape)
    if not shape or shape[-1] % block_size:
        raise _Corrupt(f"tensor {name!r} of shape {shape} does not fit {tensor_type.name} blocks of {block_size}")
    return TensorInfo(name, shape, tensor_type, offset, elements // block_size * type_size)


def _checked_count(count: int, min_item_bytes: int, pos: int, size: int, what: str) -> int:
    """Reject counts that cannot fit in the rest of the file (a corrupt count would loop for ages)."""
    if count * min_item_bytes > size - pos:
        raise _Corrupt(f"{count} {what} cannot fit in the {size - pos} bytes left at offset {pos}")
    return count


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise _Corrupt(f"a string of {length} bytes at offset {pos} runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int, size: int) -> tuple[Any, int]:
    """One metadata value and the offset just past it."""
    if value_type in _SCALAR_TYPES:
        fmt = _SCALAR_TYPES[value_type][0]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type != _ARRAY:
        raise _Corrupt(f"unknown metadata value type {value_type} at offset {pos}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _SCALAR_TYPES:
        dtype = np.dtype(_SCALAR_TYPES[item_type][1])
        _checked_count(count, dtype.itemsize, pos, size, "array items")
        return np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy(), pos + count * dtype.itemsize
    if item_type == _STRING:
        items = []
        for _ in range(_checked_count(count, 8, pos, size, "array items")):
            item, pos = _read_string(buf, pos)
            items.append(item)
        return items, pos
    raise _Corrupt(f"unsupported metadata array item type {item_type} at offset {pos}")
