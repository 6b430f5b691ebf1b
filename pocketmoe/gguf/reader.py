"""One GGUF file: header, metadata, tensor infos, all checked, and zero-copy views of tensor data."""

from __future__ import annotations

import math
import mmap
import warnings
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pocketmoe.gguf.values import VALUE_TYPE_NAMES, Cursor, GGUFError

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFError", "TensorInfo", "GGUFFile", "open_gguf", "type_sizes", "type_name"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, u32 version, u64 n_tensors, u64 n_kv
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
INT64_MAX = 2**63 - 1
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one ne, type, offset
_SIZES: dict[int, tuple[int, int]] = {int(t): bs for t, bs in GGML_QUANT_SIZES.items()}


def type_sizes(ggml_type: int) -> tuple[int, int] | None:
    """(values per block, bytes per block) of a GGML type id, or None if gguf does not know it."""
    return _SIZES.get(ggml_type)


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ne: tuple[int, ...]      # GGUF order (ne[0] fastest)
    shape: tuple[int, ...]   # torch order = reversed(ne)
    offset: int              # absolute byte offset in its file
    nbytes: int
    file_index: int          # which shard holds it (0 for single files)

    @property
    def row_bytes(self) -> int:
        block, size = _SIZES[self.ggml_type]
        return self.ne[0] // block * size

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


class GGUFFile:
    """One GGUF file, memory-mapped read-only and fully checked when opened.

    Views from `raw`/`raw_torch` share the file's pages: they must not be written, and they keep
    the mapping alive after `close()` until they are freed.
    """

    def __init__(self, path: str | Path, file_index: int = 0) -> None:
        self.path = Path(path)
        self.file_index = file_index
        self.metadata: dict[str, object] = {}
        self.metadata_types: dict[str, int] = {}
        self.array_types: dict[str, int] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._mmap = self._map()
        try:
            self._parse(Cursor(self._mmap, self.path, len(self._mmap)))
        except BaseException:
            self.close()
            raise
        self._data: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)

    def _map(self) -> mmap.mmap:
        try:
            with open(self.path, "rb") as f:
                head = f.read(HEADER_BYTES)
                if len(head) >= 4 and head[:4] != GGUF_MAGIC:
                    raise GGUFError(
                        f"{self.path}: not a GGUF file; expected magic b'GGUF' at byte 0, got {head[:4]!r}"
                    )
                if len(head) < HEADER_BYTES:
                    raise GGUFError(
                        f"{self.path}: file is truncated: it has {len(head)} bytes, "
                        f"shorter than the {HEADER_BYTES}-byte GGUF header"
                    )
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file; expected a GGUF file at this path") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory; expected a GGUF file (use open_bundle)") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot be read ({e.strerror or e}); expected a readable file") from None

    def _parse(self, cur: Cursor) -> None:
        cur.pos = 4
        self.version = cur.u32("the version")
        if self.version not in SUPPORTED_VERSIONS:
            raise cur.error(self._version_problem(self.version))
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata key count")
        least = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
        if least > cur.remaining():
            raise cur.error(
                f"file is truncated or corrupt: the header claims {n_tensors} tensors and {n_kv} metadata "
                f"keys (at least {least} bytes), but only {cur.remaining()} bytes follow it"
            )
        self._parse_metadata(cur, n_kv)
        self.alignment = self._alignment(cur)
        seen: set[str] = set()
        infos = [self._parse_tensor_info(cur, i, seen) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self._place_tensors(cur, infos)

    @staticmethod
    def _version_problem(version: int) -> str:
        if version == 1:
            return "GGUF version 1 is not supported (it uses 32-bit counts); expected 2 or 3, got 1"
        if version & 0xFFFF == 0 and version:
            return (f"looks like a big-endian GGUF file (version field {version:#010x}); "
                    "expected a little-endian file of version 2 or 3")
        return f"unsupported GGUF version; expected 2 or 3, got {version}"

    def _parse_metadata(self, cur: Cursor, n_kv: int) -> None:
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise cur.error(f"metadata key {key!r} appears twice; expected each key once")
            vtype = cur.u32(f"the value type of metadata key {key!r}")
            value, etype = cur.value(vtype, f"metadata value {key!r}")
            self.metadata[key] = value
            self.metadata_types[key] = vtype
            if etype is not None:
                self.array_types[key] = etype

    def _alignment(self, cur: Cursor) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        vtype = self.metadata_types["general.alignment"]
        value = self.metadata["general.alignment"]
        if vtype != 4:
            raise cur.error(f"general.alignment has type {VALUE_TYPE_NAMES.get(vtype, vtype)}; expected u32")
        if value == 0 or value & (value - 1):
            raise cur.error(f"general.alignment is {value}; expected a nonzero power of two")
        return value

    def _parse_tensor_info(self, cur: Cursor, i: int, seen: set[str]) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string(f"the name of tensor #{i}")
        if name in seen:
            raise cur.error(f"tensor {name!r} appears twice; expected each tensor name once")
        seen.add(name)
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"tensor {name!r} has n_dims {n_dims}; expected 1 to {MAX_DIMS}")
        ne = cur.u64s(n_dims, f"the dims of tensor {name!r}")
        for d, n in enumerate(ne):
            if n == 0 or n > INT64_MAX:
                signed = n - 2**64 if n > INT64_MAX else n
                raise cur.error(f"tensor {name!r} has dim ne[{d}] = {signed}; expected a positive size")
        if math.prod(ne) > INT64_MAX:
            raise cur.error(f"tensor {name!r} has dims {list(ne)} with more than 2**63-1 elements in all")
        ggml_type = cur.u32(f"the type of tensor {name!r}")
        sizes = _SIZES.get(ggml_type)
        if sizes is None:
            raise cur.error(
                f"tensor {name!r} has unknown GGML type id {ggml_type}; expected one of {sorted(_SIZES)}"
            )
        if ne[0] % sizes[0]:
            raise cur.error(
                f"tensor {name!r} of type {type_name(ggml_type)} has rows of {ne[0]} values; "
                f"expected a multiple of its block size {sizes[0]}"
            )
        rel = cur.u64(f"the data offset of tensor {name!r}")
        if rel % self.alignment:
            raise cur.error(
                f"tensor {name!r} has data offset {rel}, not aligned; expected a multiple of {self.alignment}"
            )
        return name, ne, ggml_type, rel

    def _place_tensors(self, cur: Cursor, infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        data_bytes = cur.size - self.data_offset
        placed: list[TensorInfo] = []
        for name, ne, ggml_type, rel in infos:
            block, size = _SIZES[ggml_type]
            nbytes = math.prod(ne[1:]) * (ne[0] // block * size)
            if rel >= max(data_bytes, 0):
                raise cur.error(
                    f"tensor {name!r} has data offset {rel}, out of range; expected less than the "
                    f"{max(data_bytes, 0)} bytes of tensor data in the file (truncated or corrupt)"
                )
            if rel + nbytes > data_bytes:
                raise cur.error(
                    f"file is truncated: tensor {name!r} needs bytes up to {self.data_offset + rel + nbytes}, "
                    f"but the file has {cur.size} bytes"
                )
            shape = tuple(reversed(ne))
            info = TensorInfo(name, ggml_type, ne, shape, self.data_offset + rel, nbytes, self.file_index)
            placed.append(info)
            self.tensors[name] = info
        by_start = sorted(placed, key=lambda t: t.offset)
        for a, b in pairwise(by_start):
            if b.offset < a.offset + a.nbytes:
                raise cur.error(
                    f"tensor {b.name!r} at byte {b.offset} overlaps tensor {a.name!r} "
                    f"({a.offset}..{a.offset + a.nbytes}); expected disjoint tensor data"
                )

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: has no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 view of a tensor, shape = shape[:-1] + (row_bytes,)."""
        info = self.info(name)
        if self._data is None:
            raise GGUFError(f"{self.path}: is closed; expected an open file to read tensor {name!r}")
        flat = self._data[info.offset:info.offset + info.nbytes]
        return flat.reshape(info.shape[:-1] + (info.row_bytes,))

    def raw_torch(self, name: str) -> torch.Tensor:
        """`raw` as a torch.uint8 tensor on the same memory; it must not be written."""
        return as_torch(self.raw(name))

    def prefetch(self, name: str) -> bool:
        """Ask the kernel to read a tensor's pages in now, in the background (MADV_WILLNEED).

        For tensors read a row at a time in no order, such as the token embedding: each new row would
        otherwise fault its page in from disk when first used. False where madvise is not available.
        """
        info = self.info(name)
        advice = getattr(mmap, "MADV_WILLNEED", None)
        if advice is None or self._data is None:
            return False
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._mmap.madvise(advice, start, info.offset + info.nbytes - start)
        except (OSError, ValueError):
            return False
        return True

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def close(self) -> None:
        """Unmaps the file; views still held keep the mapping alive until they are freed."""
        self._data = None
        try:
            self._mmap.close()
        except BufferError:
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


def as_torch(array: np.ndarray) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)

