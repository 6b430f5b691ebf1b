"""Bounds-checked reads of GGUF header fields and metadata values from a memory-mapped file.

Every length or count read from the file is checked against the bytes left before anything is
allocated, so a corrupt header can cost an error message and nothing more.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from pocketmoe.errors import PocketMoEError


class GGUFError(PocketMoEError):
    """A GGUF file or bundle that cannot be used as it is."""


STRING = 8
ARRAY = 9
BOOL = 7
VALUE_TYPE_NAMES: dict[int, str] = {
    0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
    8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64",
}
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_SCALARS: dict[int, struct.Struct] = {
    t: struct.Struct(f) for t, f in
    {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}.items()
}
_DTYPES: dict[int, np.dtype] = {t: np.dtype(s.format) for t, s in _SCALARS.items()}
# Smallest encoding of one element: a string is at least its u64 length, an array its type + length.
_MIN_ELEMENT_BYTES = {**{t: s.size for t, s in _SCALARS.items()}, STRING: 8, ARRAY: 12}
MAX_ARRAY_NESTING = 16
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Cursor:
    """A read position in a mapped GGUF file; each read checks that the bytes exist."""

    def __init__(self, buf: object, path: Path, size: int) -> None:
        self.buf = buf
        self.path = path
        self.size = size
        self.pos = 0

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(
                f"file is truncated or corrupt: {what} at byte {self.pos} needs {n} bytes, "
                f"but only {self.size - self.pos} remain"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def u64s(self, n: int, what: str) -> tuple[int, ...]:
        self.need(8 * n, what)
        vals = struct.unpack_from(f"<{n}Q", self.buf, self.pos)
        self.pos += 8 * n
        return vals

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        start = self.pos
        self.pos += n
        return self._decode(self.buf[start:start + n], start, what)

    def _decode(self, raw: bytes, start: int, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(
                f"{what} at byte {start} is not valid UTF-8 (bad byte at position {e.start}); "
                "expected UTF-8 text"
            ) from None

    def value(self, vtype: int, what: str, depth: int = 0) -> tuple[object, int | None]:
        """Reads one value of GGUF type `vtype`; returns it and, for arrays, the element type."""
        if vtype == STRING:
            return self.string(what), None
        if vtype == ARRAY:
            return self.array(what, depth)
        scalar = _SCALARS.get(vtype)
        if scalar is None:
            raise self.error(f"{what} has unknown value type {vtype}; expected one of 0..12")
        self.need(scalar.size, what)
        (v,) = scalar.unpack_from(self.buf, self.pos)
        if vtype == BOOL:
            if v > 1:
                raise self.error(f"{what} at byte {self.pos} is a bool stored as {v}; expected 0 or 1")
            v = bool(v)
        self.pos += scalar.size
        return v, None

    def array(self, what: str, depth: int) -> tuple[list, int]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.error(f"{what} nests arrays {depth + 1} deep; expected at most {MAX_ARRAY_NESTING}")
        etype = self.u32(f"the element type of {what}")
        if etype not in _MIN_ELEMENT_BYTES:
            raise self.error(f"{what} has unknown element type {etype}; expected one of 0..12")
        n = self.u64(f"the length of {what}")
        least = n * _MIN_ELEMENT_BYTES[etype]
        if least > self.remaining():
            raise self.error(
                f"file is truncated or corrupt: {what} claims {n} {VALUE_TYPE_NAMES[etype]} elements "
                f"(at least {least} bytes) at byte {self.pos}, but only {self.remaining()} bytes remain"
            )
        if etype == STRING:
            return self._strings(n, what), etype
        if etype == ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1)[0] for i in range(n)], etype
        dtype = _DTYPES[etype]
        view = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        worst = int(view.max()) if etype == BOOL and n else 0
        items = (view.astype(bool) if etype == BOOL else view).tolist()
        del view  # a live view would pin the mapping if the error below is kept with its traceback
        if worst > 1:
            raise self.error(f"{what} holds a bool stored as {worst}; expected 0 or 1")
        self.pos += n * dtype.itemsize
        return items, etype

    def _strings(self, n: int, what: str) -> list[str]:
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        pos = self.pos
        try:
            for _ in range(n):
                (length,) = unpack(buf, pos)
                end = pos + 8 + length
                if end > size:
                    break
                append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except (struct.error, UnicodeDecodeError):
            pass
        self.pos = pos
        if len(out) < n:
            self.string(f"{what}[{len(out)}]")  # re-reads the bad element with every check, which raises
            raise AssertionError("unreachable: a string that failed to parse parsed on the second read")
        return out
