"""Safetensors headers: tensor names, shapes and dtypes, read without loading any data."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import final

from kernelbay.errors import CheckpointError

__all__ = ["SAFETENSORS_DTYPES", "TensorInfo", "read_safetensors_header"]

#: safetensors dtype codes -> torch dtype names, with element size in bytes (F4 packs 2/byte
#: in U8 tensors in practice, so it is not listed).
SAFETENSORS_DTYPES: dict[str, tuple[str, float]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
}

_MAX_HEADER = 100 * 1024 * 1024


@final
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: name, shape, torch dtype name, file, byte range."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Tensors of one safetensors file, validated against the file's size.

    Raises ``CheckpointError`` naming the file (and tensor) for a truncated file, a header
    that is not JSON, an unknown dtype, or a byte range that does not match its shape.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"file is {size} bytes, too short for a "
                                      "safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                raise CheckpointError(path, f"header length {length} does not fit in a "
                                      f"{size}-byte file (truncated or not safetensors)")
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    data_size = size - 8 - length
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(path, f"malformed header entry: {exc!r}", tensor=name) from exc
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(path, f"unknown dtype {code!r}; known: "
                                  f"{sorted(SAFETENSORS_DTYPES)}", tensor=name)
        dtype, itemsize = SAFETENSORS_DTYPES[code]
        info = TensorInfo(name, shape, dtype, path, start, end)
        if end > data_size:
            raise CheckpointError(path, f"data ends at byte {end} but the file holds "
                                  f"{data_size} data bytes (truncated file)", tensor=name)
        if end - start != int(info.numel * itemsize):
            raise CheckpointError(path, f"byte range {end - start} does not match shape "
                                  f"{list(shape)} of {dtype}", tensor=name)
        tensors[name] = info
    return tensors
