"""A merged view over the 1..N shard files of one GGUF model (`PREFIX-0000k-of-0000N.gguf`)."""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pocketmoe.gguf.reader import GGUFFile, TensorInfo, as_torch
from pocketmoe.gguf.values import INTEGER_TYPES, GGUFError

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFBundle", "open_bundle", "find_shards", "SHARD_PATTERN"]

SHARD_PATTERN = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


class GGUFBundle:
    """One model over 1..N shards: shard 0's metadata, all shards' tensors merged in shard order."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self.files: list[GGUFFile] = []
        try:
            for i, p in enumerate(self.paths):
                self.files.append(GGUFFile(p, file_index=i))
            self._check_split_keys()
            self.tensors = self._merge()
        except BaseException:
            self.close()
            raise
        first = self.files[0]
        self.metadata: dict[str, object] = first.metadata
        self.metadata_types: dict[str, int] = first.metadata_types
        self.array_types: dict[str, int] = first.array_types

    def _check_split_keys(self) -> None:
        n = len(self.files)
        total = sum(len(f.tensors) for f in self.files)
        expected = {"split.no": None, "split.count": n, "split.tensors.count": total}
        for i, f in enumerate(self.files):
            present = [k for k in SPLIT_KEYS if k in f.metadata]
            if not present and n == 1:
                continue
            expected["split.no"] = i
            for key in SPLIT_KEYS:
                if key not in f.metadata:
                    raise GGUFError(
                        f"{f.path}: metadata key {key} is missing; expected it in every shard of a "
                        f"{n}-shard bundle (value {expected[key]})"
                    )
                value = f.metadata[key]
                if f.metadata_types[key] not in INTEGER_TYPES:
                    raise GGUFError(f"{f.path}: {key} is {value!r}; expected an integer ({expected[key]})")
                if value != expected[key]:
                    raise GGUFError(f"{f.path}: {key} is {value}; expected {expected[key]} "
                                    f"({self._split_hint(key, i, n, total)})")

    @staticmethod
    def _split_hint(key: str, i: int, n: int, total: int) -> str:
        if key == "split.no":
            return f"it is file {i + 1} of {n} by name, and split.no counts from 0"
        if key == "split.count":
            return f"the bundle has {n} shard files"
        return f"the {n} shards hold {total} tensors in all"

    def _merge(self) -> dict[str, TensorInfo]:
        merged: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in f.tensors.items():
                if name in merged:
                    other = self.paths[merged[name].file_index]
                    raise GGUFError(
                        f"{f.path}: tensor {name!r} is also in {other.name}; expected each tensor "
                        "in exactly one shard"
                    )
                merged[name] = info
        return merged

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            found = "missing" if arch is None else f"{arch!r}"
            raise GGUFError(f"{self.paths[0]}: general.architecture is {found}; expected a string")
        return arch

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.paths[0]}: the bundle has no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 [*shape[:-1], row_bytes] view of a tensor's data."""
        return self.files[self.info(name).file_index].raw(name)

    def raw_torch(self, name: str) -> torch.Tensor:
        """`raw` as torch.uint8 on the same memory (no copy); it must not be written."""
        return as_torch(self.raw(name))

    def prefetch(self, name: str) -> bool:
        """Read a tensor's pages in the background (see GGUFFile.prefetch)."""
        return self.files[self.info(name).file_index].prefetch(name)

    def expert_raw(self, name: str, expert: int) -> np.ndarray:
        """uint8 [out, row_bytes] of expert `expert` of a stacked tensor [E, out, in]."""
        info = self.info(name)
        if len(info.shape) != 3:
            raise GGUFError(
                f"{self.paths[info.file_index]}: tensor {name!r} has shape {list(info.shape)}; "
                "expected a 3-D stacked expert tensor [E, out, in]"
            )
        e = operator.index(expert)
        if not 0 <= e < info.shape[0]:
            raise GGUFError(
                f"{self.paths[info.file_index]}: expert {e} of tensor {name!r} does not exist; "
                f"expected 0 <= expert < {info.shape[0]}"
            )
        return self.raw(name)[e]

    def expert_bytes(self, name: str, expert: int) -> np.ndarray:
        """uint8 1-D view of the contiguous bytes [e*out*row_bytes, (e+1)*out*row_bytes) of the tensor."""
        return self.expert_raw(name, expert).reshape(-1)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_by_type(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.tensors.values():
            out[t.ggml_type] = out.get(t.ggml_type, 0) + t.nbytes
        return out

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> GGUFBundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __repr__(self) -> str:
        return f"GGUFBundle({str(self.paths[0])!r}, {len(self.files)} shards, {len(self.tensors)} tensors)"


def _shard_group(path: Path) -> tuple[str, int] | None:
    m = SHARD_PATTERN.match(path.name)
    return None if m is None else (m.group(1), int(m.group(3)))


def _bundle_in_directory(directory: Path) -> Path:
    ggufs = sorted(p for p in directory.iterdir() if p.name.endswith(".gguf") and p.is_file())
    groups: dict[object, list[str]] = {}
    for p in ggufs:
        groups.setdefault(_shard_group(p) or p.name, []).append(p.name)
    if len(groups) != 1:
        found = ", ".join(
            names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more shards"
            for names in groups.values()
        ) or "no .gguf files"
        raise GGUFError(
            f"{directory}: holds {len(groups)} GGUF bundles ({found}); expected exactly one, "
            "so pass the path of one file instead"
        )
    return directory / next(iter(groups.values()))[0]


def find_shards(path: str | Path) -> list[Path]:
    """The shard paths of the bundle that `path` (any shard, a single file, or a directory) belongs to."""
    path = Path(path)
    if path.is_dir():
        path = _bundle_in_directory(path)
    elif not path.exists():
        raise GGUFError(f"{path}: no such file or directory; expected a GGUF file, shard or directory")
    m = SHARD_PATTERN.match(path.name)
    if m is None:
        return [path]
    prefix, k, n = m.group(1), int(m.group(2)), int(m.group(3))
    if not 1 <= k <= n:
        raise GGUFError(f"{path}: the name says shard {k} of {n}; expected 1 <= shard <= count")
    paths = [path.with_name(f"{prefix}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(
            f"{path}: the bundle is missing shard file(s) {', '.join(missing)}; expected all {n} "
            f"shards {prefix}-000NN-of-{n:05d}.gguf in {path.parent}"
        )
    return paths


def open_bundle(path: str | Path) -> GGUFBundle:
    """Opens a single file, any shard of a bundle, or a directory holding exactly one bundle."""
    return GGUFBundle(find_shards(path))
