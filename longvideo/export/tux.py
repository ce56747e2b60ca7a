"""Reading the checkpoints of tux's `StreamingCheckpointer` (LWM's `params` files) tensor by tensor.

`scan_params` reads only the msgpack headers and seeks past the bytes, so a file is indexed without
being read; `read_elements` then reads any element range of one array. Nothing is unpickled or
evaluated: exactly the types of the format (docs/lwm.md, "The params file") are understood,
anything else is a TuxFormatError.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import torch

EXT_NDARRAY, EXT_NPSCALAR = 1, 3
CHUNKED = "__msgpack_chunked_array__"

TORCH_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "bool",
    )
}


class TuxFormatError(ValueError):
    """The file is not a tux streaming checkpoint of arrays (or is truncated); names the position."""


class _Span(NamedTuple):
    """Bytes of a msgpack bin/str left in the file: `size` bytes at `offset`."""

    offset: int
    size: int


class _Array(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    data: _Span


@dataclass
class ArrayRecord:
    """One array of the checkpoint: where its C-order bytes lie (several spans when chunked)."""

    key: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    spans: list[tuple[int, int]] = field(default_factory=list)  # (file offset, bytes), in order

    @property
    def name(self) -> str:
        return "/".join(self.key)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class _Reader:
    """Just enough msgpack to walk the checkpoint's structure; bins and strs beyond `small` bytes
    are returned as spans of the file instead of being read."""

    def __init__(self, f: IO[bytes], path: str):
        self.f, self.path = f, path

    def _fail(self, what: str):
        raise TuxFormatError(f"{self.path}: {what} at byte {self.f.tell()}")

    def _read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            self._fail(f"file ends inside a value (wanted {n} bytes)")
        return b

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._read(n), "big")

    def _bytes(self, n: int, small: int):
        if n <= small:
            return self._read(n)
        span = _Span(self.f.tell(), n)
        self.f.seek(n, os.SEEK_CUR)
        return span

    def value(self, small: int = 4096) -> Any:
        b = self._read(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self._map(b & 0x0F, small)
        if 0x90 <= b <= 0x9F:
            return [self.value(small) for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self._str(b & 0x1F, small)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xC4, 0xC5, 0xC6):  # bin 8/16/32
            return self._bytes(self._uint(1 << (b - 0xC4)), small)
        if b in (0xC7, 0xC8, 0xC9):  # ext 8/16/32
            return self._ext(self._uint(1 << (b - 0xC7)))
        if b == 0xCA:
            return struct.unpack(">f", self._read(4))[0]
        if b == 0xCB:
            return struct.unpack(">d", self._read(8))[0]
        if 0xCC <= b <= 0xCF:  # uint 8..64
            return self._uint(1 << (b - 0xCC))
        if 0xD0 <= b <= 0xD3:  # int 8..64
            return int.from_bytes(self._read(1 << (b - 0xD0)), "big", signed=True)
        if 0xD4 <= b <= 0xD8:  # fixext 1..16
            return self._ext(1 << (b - 0xD4))
        if b in (0xD9, 0xDA, 0xDB):  # str 8/16/32
            return self._str(self._uint(1 << (b - 0xD9)), small)
        if b in (0xDC, 0xDD):  # array 16/32
            return [self.value(small) for _ in range(self._uint(2 if b == 0xDC else 4))]
        if b in (0xDE, 0xDF):  # map 16/32
            return self._map(self._uint(2 if b == 0xDE else 4), small)
        self._fail(f"unsupported msgpack type 0x{b:02x}")

    def _str(self, n: int, small: int):
        got = self._bytes(n, small)
        return got.decode("utf-8", errors="replace") if isinstance(got, bytes) else got

    def _map(self, n: int, small: int) -> dict:
        pairs = [(self.value(small), self.value(small)) for _ in range(n)]
        return {k.decode() if isinstance(k, bytes) else k: v for k, v in pairs}

    def _ext(self, n: int) -> Any:
        code = int.from_bytes(self._read(1), "big", signed=True)
        start = self.f.tell()
        if code not in (EXT_NDARRAY, EXT_NPSCALAR):
            self._fail(
                f"msgpack extension type {code} (only flax's arrays, types 1 and 3, are read)"
            )
        tpl = self.value(small=256)  # (shape, dtype name, raw bytes): the bytes always stay a span
        if self.f.tell() != start + n:
            self._fail(
                f"array extension of {n} bytes does not hold one (shape, dtype, data) triple"
            )
        if not (isinstance(tpl, list) and len(tpl) == 3 and isinstance(tpl[0], list)):
            self._fail("array extension is not (shape, dtype, data)")
        shape, dtype, data = tpl
        dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
        if isinstance(data, bytes):  # small enough to have been read: its place is just behind us
            data = _Span(self.f.tell() - len(data), len(data))
        if not isinstance(data, _Span) or not all(isinstance(d, int) and d >= 0 for d in shape):
            self._fail("array extension with a bad shape or data")
        return _Array(tuple(int(d) for d in shape), str(dtype), data)

    def payload(self) -> tuple[int, int]:
        """The (offset, size) of the bin (or str, from msgpack writers without a bin type) that
        holds one record's serialized value; the file is left at its start."""
        b = self._read(1)[0]
        if b in (0xC4, 0xC5, 0xC6):
            n = self._uint(1 << (b - 0xC4))
        elif b in (0xD9, 0xDA, 0xDB):
            n = self._uint(1 << (b - 0xD9))
        elif 0xA0 <= b <= 0xBF:
            n = b & 0x1F
        else:
            self._fail(f"record value of msgpack type 0x{b:02x}, expected bytes")
        return self.f.tell(), n


def _record(key: tuple[str, ...], value: Any, reader: _Reader) -> ArrayRecord:
    name = "/".join(key)
    if isinstance(value, dict) and value.get(CHUNKED):
        shape_map, chunk_map = value.get("shape", {}), value.get("chunks", {})
        try:
            shape = tuple(int(shape_map[str(i)]) for i in range(len(shape_map)))
            chunks = [chunk_map[str(i)] for i in range(len(chunk_map))]
        except KeyError:
            reader._fail(f"chunked array '{name}' with a gap in its shape or chunks")
        if (
            not chunks
            or not all(isinstance(c, _Array) for c in chunks)
            or len({c.dtype for c in chunks}) > 1
        ):
            reader._fail(f"chunked array '{name}' without uniform array chunks")
    elif isinstance(value, _Array):
        shape, chunks = value.shape, [value]
    else:
        reader._fail(f"record '{name}' is not an array ({type(value).__name__})")
    if chunks[0].dtype not in TORCH_DTYPES:
        reader._fail(
            f"array '{name}' has dtype {chunks[0].dtype}, not one of {sorted(TORCH_DTYPES)}"
        )
    rec = ArrayRecord(key, chunks[0].dtype, shape, [(c.data.offset, c.data.size) for c in chunks])
    if sum(n for _, n in rec.spans) != rec.nbytes:
        reader._fail(
            f"array '{name}' of shape {rec.shape} {rec.dtype} holds "
            f"{sum(n for _, n in rec.spans)} bytes, expected {rec.nbytes}"
        )
    return rec


def scan_params(path: str | Path) -> list[ArrayRecord]:
    """Index every array of a tux streaming checkpoint without reading the arrays' bytes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"params file not found: {path}")
    records: list[ArrayRecord] = []
    with open(path, "rb") as f:
        reader = _Reader(f, str(path))
        while True:
            head = f.read(1)
            if not head:
                break
            if head[0] != 0x92:  # each record is a 2-element array
                f.seek(-1, os.SEEK_CUR)
                reader._fail("expected a (key path, value) record")
            key = reader.value(small=1 << 16)
            if not isinstance(key, list) or not all(isinstance(k, (str, bytes)) for k in key):
                reader._fail("record key is not a list of names")
            key = tuple(k.decode() if isinstance(k, bytes) else k for k in key)
            start, size = reader.payload()
            value = reader.value(small=1 << 16)
            if f.tell() != start + size:
                reader._fail(f"record '{'/'.join(key)}' holds more than one value")
            records.append(_record(key, value, reader))
    if not records:
        raise TuxFormatError(f"{path}: no arrays")
    return records


def read_elements(
    f: IO[bytes], rec: ArrayRecord, start: int = 0, count: int | None = None
) -> torch.Tensor:
    """Elements [start, start + count) of `rec`'s flat C-order array, as a fresh 1-D tensor."""
    count = rec.numel - start if count is None else count
    if start < 0 or count < 0 or start + count > rec.numel:
        raise ValueError(f"elements [{start}, {start + count}) outside '{rec.name}' ({rec.numel})")
    item = rec.itemsize
    buf = np.empty(count * item, np.uint8)
    lo, hi, pos, filled = start * item, (start + count) * item, 0, 0
    for off, n in rec.spans:  # the chunks in order: copy the part of each that overlaps [lo, hi)
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            f.seek(off + a - pos)
            view = memoryview(buf)[filled : filled + b - a]
            while len(view):
                got = f.readinto(view)
                if not got:
                    raise TuxFormatError(f"'{rec.name}': the file ends inside the array")
                view = view[got:]
            filled += b - a
        pos += n
    return torch.from_numpy(buf).view(rec.torch_dtype)
