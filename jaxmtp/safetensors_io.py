"""Minimal safetensors reader/writer on numpy memory maps (bfloat16 through ml_dtypes, no torch needed).

Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``, raw data.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # block-FP8 checkpoints (jaxmtp.fp8)
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),  # readable; the loader names it as unsupported
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read."""


def read_header(path: str) -> dict:
    """``{name: {"dtype", "shape", "data_offsets"}}`` plus the data start under ``"__data_start__"``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path}: truncated file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise SafetensorsError(f"{path}: implausible header length {n}")
            header = json.loads(f.read(n))
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{path}: corrupt header ({e})") from e
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + n
    return header


class SafetensorsFile:
    """Lazy access to the tensors of one file: ``keys()``, ``shape(name)``, ``get(name) -> np.ndarray``."""

    def __init__(self, path: str):
        self.path = path
        self.header = read_header(path)
        self.start = self.header.pop("__data_start__")
        self.size = os.path.getsize(path)
        self._mm = None

    def keys(self):
        return list(self.header)

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.header[name]["dtype"]
        if code not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array backed by the file (copy it to keep it past ``close``)."""
        info = self.header[name]
        dtype = self.dtype(name)
        lo, hi = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if hi - lo != count * dtype.itemsize or self.start + hi > self.size:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is truncated or its offsets are inconsistent")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[self.start + lo : self.start + hi].view(dtype).reshape(info["shape"])

    def close(self):
        self._mm = None


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (numpy, any dtype in :data:`DTYPES`) as one safetensors file, names sorted."""
    header: dict = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"cannot store dtype {a.dtype} of {name!r}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
    os.replace(tmp, path)
