"""The prefix cache's second tier: computed KV pages kept in files, so a restarted server (or one whose pool evicted
them) takes a long system prompt's rows from disk instead of computing them again.

On a CPU a 20k-token agent prompt (Claude Code's, a coding assistant's) takes minutes to prefill; its KV rows take a
few hundred MB (DeepSeek-V2-Lite: 31 KB a token in f16). Each page the prefix index takes (PagedKVCache.commit) is
also written to a file named by its digest, which chains every token from position 0 to the page's end; a prompt
whose pages the pool no longer holds finds them there (PagedKVCache.attach) and reads them into free pages. Rows are
only reused where they are bitwise the rows a prefill would write, so the files sit under a key of the model (its
metadata, tensor layout, sizes and a sample of every tensor's bytes), the op backend and the KV layout; another
model, quantization, backend or KV dtype never sees them. A file that is short, from another key or unreadable is a
miss and is removed. The files are kept within a byte budget, least recently used first.

File: MAGIC, the key (16 bytes), the digest (16), then the page's rows [L, page, W] as the pool stores them.

A slot file (llama-server's POST /slots/{id}?action=save, write_slot_file) holds one prompt's pages whole, for a
later restore (read_slot_file) by the same key: SLOT_MAGIC, the key, the page count n (uint32 LE), the n * page
tokens (int32 LE), then each page's rows as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    from pocketmoe.gguf import GGUFBundle

log = logging.getLogger("pocketmoe.prefix_store")
MAGIC = b"PMKVPAGE1\0"
SLOT_MAGIC = b"PMKVSLOT1\0"
SUFFIX = ".kv"
SAMPLE = 4096  # bytes of each tensor's start and end that go into the model's key
_HEX32 = re.compile(r"[0-9a-f]{32}")  # a key's directory and a page's file name (before SUFFIX)


def model_key(bundle: GGUFBundle, backend: str, layout: tuple[int, int, int, torch.dtype]) -> bytes:
    """16 bytes that differ wherever the rows a prefill writes could: the GGUF metadata, every tensor's name, type,
    shape and a sample of its bytes, the file sizes, the op backend, and the KV layout (layers, page, width, dtype)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((backend, layout[:3], str(layout[3]))).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in bundle.metadata.items())).encode())
    h.update(repr([p.stat().st_size for p in bundle.paths]).encode())
    for name in sorted(bundle.tensors):
        info = bundle.tensors[name]
        h.update(repr((name, info.ggml_type, info.ne)).encode())
        raw = bundle.raw(name)
        h.update(raw[:SAMPLE].tobytes())
        h.update(raw[-SAMPLE:].tobytes())
    return h.digest()


class PrefixStore:
    """Pages of one model's KV rows in files under `root`, within `budget_bytes` (all keys' files count)."""

    def __init__(self, root: str | Path, key: bytes, shape: tuple[int, int, int], dtype: torch.dtype,
                 budget_bytes: int) -> None:
        self.root, self.key = Path(root), key
        self.shape, self.dtype = shape, dtype  # a page's rows: [L, page, W]
        self.budget = budget_bytes
        self.page_bytes = shape[0] * shape[1] * shape[2] * torch.tensor([], dtype=dtype).element_size()
        self.dir = self.root / key.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.loaded = self.saved = 0  # pages read into the pool, pages written
        self._files: OrderedDict[Path, int] = OrderedDict()  # every page file under root, least recently used first
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            if not (_HEX32.fullmatch(path.parent.name) and _HEX32.fullmatch(path.name.removesuffix(SUFFIX))):
                continue  # not a page of ours: never counted, never removed
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path, st.st_size))
        for tmp in self.dir.glob(f"*{SUFFIX}.tmp*"):  # a write a crash cut short (not one in flight elsewhere)
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > 60:
                    tmp.unlink()
        for _, path, size in sorted(found):
            self._files[path] = size
        self.bytes = sum(self._files.values())

    def _path(self, digest: bytes) -> Path:
        return self.dir / (digest.hex() + SUFFIX)

    def __len__(self) -> int:
        """Pages of this key kept."""
        return sum(1 for path in self._files if path.parent == self.dir)

    def __contains__(self, digest: bytes) -> bool:
        return self._path(digest) in self._files

    def load(self, digest: bytes) -> torch.Tensor | None:
        """The page's rows [L, page, W] (None: not kept, or a file that does not hold them, which goes)."""
        path = self._path(digest)
        if path not in self._files:
            return None
        head = MAGIC + self.key + digest
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # another server over the same directory trimmed it
            data = b""
        except OSError as e:
            log.warning("prefix store: %s could not be read (%s); computing the page instead", path, e)
            data = b""
        if len(data) != len(head) + self.page_bytes or not data.startswith(head):
            self._drop(path)
            return None
        self._files.move_to_end(path)
        os.utime(path)  # the order survives a restart
        self.loaded += 1
        return rows_from(data[len(head):], self.shape, self.dtype)

    def save(self, digest: bytes, rows: torch.Tensor) -> None:
        """Keep a page's rows [L, page, W] (a page kept already is left as it is), then trim to the budget."""
        path = self._path(digest)
        if path in self._files or self.page_bytes > self.budget:
            return
        data = row_bytes(rows)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_bytes(MAGIC + self.key + digest + data)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk costs the next prompt a prefill, nothing more
            log.warning("prefix store: %s could not be written (%s)", path, e)
            tmp.unlink(missing_ok=True)
            return
        self._files[path] = path.stat().st_size
        self.bytes += self._files[path]
        self.saved += 1
        while self.bytes > self.budget and self._files:
            self._drop(next(iter(self._files)))

    def discard(self, digest: bytes) -> None:
        """Forget a page (its file goes)."""
        self._drop(self._path(digest))

    def _drop(self, path: Path) -> None:
        self.bytes -= self._files.pop(path, 0)
        path.unlink(missing_ok=True)


def row_bytes(rows: torch.Tensor) -> bytes:
    """A page's rows [L, page, W] as the files hold them: the pool's bytes."""
    return rows.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def rows_from(data: bytes, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """row_bytes' rows back (a copy the caller owns)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class SlotFileError(PocketMoEError):
    """A slot file that cannot be read back here: not one, cut short, or from another model, backend or KV layout."""


def write_slot_file(path: Path, key: bytes, tokens: list[int], rows: list[torch.Tensor]) -> int:
    """Write the pages `rows` ([L, page, W] each) of `tokens` (len(rows) * page of them) to `path`, whole or not at
    all (a temporary file, then renamed); returns the bytes written."""
    head = SLOT_MAGIC + key + len(rows).to_bytes(4, "little") + np.asarray(tokens, dtype="<i4").tobytes()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")  # two saves at once: two files
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for r in rows:
                f.write(row_bytes(r))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_slot_file(path: Path, key: bytes, shape: tuple[int, int, int], dtype: torch.dtype
                   ) -> tuple[list[int], list[torch.Tensor], int]:
    """(tokens, the pages' rows [L, page, W], bytes read) of a slot file written for `key` (SlotFileError
    otherwise; OSError where it cannot be read at all)."""
    data = path.read_bytes()
    page_bytes = shape[0] * shape[1] * shape[2] * torch.tensor([], dtype=dtype).element_size()
    start = len(SLOT_MAGIC) + len(key) + 4
    if not data.startswith(SLOT_MAGIC) or len(data) < start:
        raise SlotFileError(f"{path.name} is not a slot file of this server; give a file a slot save wrote.")
    if data[len(SLOT_MAGIC):start - 4] != key:
        raise SlotFileError(f"{path.name} was saved from another model, op backend or KV layout (--kv-dtype) than "
                            "this server's, whose rows it cannot use; restore it where it was saved.")
    n = int.from_bytes(data[start - 4:start], "little")
    tokens_end = start + 4 * n * shape[1]
    if len(data) != tokens_end + n * page_bytes:
        raise SlotFileError(f"{path.name} holds {len(data)} bytes but its {n} pages need "
                            f"{tokens_end + n * page_bytes}; it was cut short or changed since it was saved.")
    tokens = np.frombuffer(data, dtype="<i4", count=n * shape[1], offset=start).tolist()
    rows = [rows_from(data[tokens_end + i * page_bytes:tokens_end + (i + 1) * page_bytes], shape, dtype)
            for i in range(n)]
    return tokens, rows, len(data)
