"""Streaming GGUF writer over gguf.GGUFWriter: tensor data is written chunk by chunk, never whole in RAM."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState
from tqdm import tqdm

from pocketmoe.errors import PocketMoEError
from pocketmoe.testing.quant_mix import tensor_nbytes

SHARD_NAME = "{}-{:05d}-of-{:05d}.gguf"


class FixtureError(PocketMoEError):
    """A fixture cannot be written as asked."""


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


def planned_bytes(plans: Iterable[TensorPlan]) -> int:
    """Bytes of tensor data (without header and alignment padding)."""
    return sum(p.nbytes for p in plans)


def output_paths(out: Path, shards: int) -> list[Path]:
    """The files a write of `shards` shards produces: `out` itself, or PREFIX-0000k-of-0000N.gguf."""
    out = Path(out)
    if shards == 1:
        return [out]
    stem = out.name[:-5] if out.name.endswith(".gguf") else out.name
    return [out.with_name(SHARD_NAME.format(stem, i + 1, shards)) for i in range(shards)]


def _int_type(value: int) -> GGUFValueType:
    return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64


def add_metadata(writer: GGUFWriter, key: str, value: object) -> None:
    """Add one KV pair. `value` is a plain python value, a (value, GGUFValueType) pair, or an object
    with .value and .type (gguf's GGUFValue). Plain ints are u32, floats f32, int arrays i32."""
    sub_type = None
    if hasattr(value, "value") and hasattr(value, "type"):
        sub_type = getattr(value, "sub_type", None) or getattr(value, "item_type", None)
        value, vtype = value.value, GGUFValueType(value.type)  # type: ignore[attr-defined]
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, vtype = value
    elif isinstance(value, bool):
        vtype = GGUFValueType.BOOL
    elif isinstance(value, (int, np.integer)):
        value, vtype = int(value), _int_type(int(value))
    elif isinstance(value, (float, np.floating)):
        value, vtype = float(value), GGUFValueType.FLOAT32
    elif isinstance(value, str):
        vtype = GGUFValueType.STRING
    elif isinstance(value, (list, np.ndarray)):
        value, vtype = list(value.tolist() if isinstance(value, np.ndarray) else value), GGUFValueType.ARRAY
    else:
        raise FixtureError(f"metadata key {key!r} has a value of unsupported type {type(value).__name__}.")
    if vtype == GGUFValueType.ARRAY and not value:
        raise FixtureError(f"metadata key {key!r} is an empty array, which GGUF cannot store.")
    writer.add_key_value(key, value, vtype, sub_type=sub_type)


def _split(writer: GGUFWriter, shards: int) -> None:
    names = list(writer.tensors[0].items())
    if not 1 <= shards <= len(names):
        raise FixtureError(f"cannot split {len(names)} tensors into {shards} shards; use 1 to {len(names)}.")
    bounds = np.linspace(0, len(names), shards + 1).round().astype(int)
    writer.tensors = [dict(names[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _write_tensor(writer: GGUFWriter, plan: TensorPlan, chunks: Iterable[np.ndarray] | None, bar: tqdm) -> None:
    assert writer.fout is not None
    file_id = next(i for i, t in enumerate(writer.tensors) if t)
    fout = writer.fout[file_id]
    name = next(iter(writer.tensors[file_id]))
    info = writer.tensors[file_id].pop(name)
    assert name == plan.name
    writer.write_padding(fout, fout.tell())
    written = 0
    if chunks is None:  # sparse: the data is a hole in the file, read back as zero bytes
        fout.seek(info.nbytes, 1)
        fout.truncate()
        written = info.nbytes
        bar.update(written)
    for chunk in chunks or ():
        data = np.ascontiguousarray(chunk)
        fout.write(data.data.cast("B"))
        written += data.nbytes
        bar.update(data.nbytes)
    if written != info.nbytes:
        raise FixtureError(f"tensor {name} got {written} bytes of data, expected {info.nbytes}.")
    writer.write_padding(fout, written)
    writer.state = WriterState.WEIGHTS


def write_gguf(out: Path, arch: str, metadata: Mapping[str, object], plans: Sequence[TensorPlan],
               chunks: Callable[[TensorPlan], Iterable[np.ndarray]] | None, shards: int = 1,
               progress: bool = False) -> list[Path]:
    """Write a GGUF file (or `shards` shards) tensor by tensor; returns the paths written.

    `chunks(plan)` yields the tensor's raw bytes (any dtype, C order) in pieces, in file order. With
    `chunks=None` the file is sparse: every tensor's data is a hole (zero bytes, no disk space), which
    is a valid file for inspection and placement reports at any size, not a model worth running.
    Shard 0 carries all metadata; every shard carries split.no / split.count / split.tensors.count.
    """
    if shards < 1:
        raise FixtureError(f"--shards must be at least 1, got {shards}.")
    paths = output_paths(Path(out), shards)
    writer = GGUFWriter(None, arch)
    for key, value in metadata.items():
        if key != "general.architecture":
            add_metadata(writer, key, value)
    for p in plans:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=GGMLQuantizationType(p.ggml_type))
    if shards > 1:
        _split(writer, shards)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    writer.fout = [open(path, "wb") for path in paths]  # noqa: SIM115 (closed below)
    writer.state = WriterState.EMPTY
    ok = False
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=planned_bytes(plans), unit="B", unit_scale=True, file=sys.stderr,
                  disable=not progress, desc=paths[0].name) as bar:
            for p in plans:
                _write_tensor(writer, p, None if chunks is None else chunks(p), bar)
        ok = True
    finally:
        writer.close()
        if not ok:
            for path in paths:
                path.unlink(missing_ok=True)
    return paths
