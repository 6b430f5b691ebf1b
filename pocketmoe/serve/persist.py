"""A store's entries mirrored on disk, one JSON file each, so stored responses and conversations outlive the server
(`serve --responses-store-dir DIR`).

An entry is written whole to a temporary file that is then renamed over the old one, so a crash leaves the old
entry or the new, never half of one; its file goes when the entry does (deleted, or dropped to make room). A use
sets the file's modification time, and at start the files are read back least recently used first, so the store's
order (which entry goes first to make room) is what it was. Only names the store gave (`resp_...`, `conv_...`,
letters, digits and `_`) are files; a file that does not read as JSON is left where it is, with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("pocketmoe.serve")

_NAME = re.compile(r"[A-Za-z0-9_]{1,128}")


class JsonDir:
    """One JSON file per entry under `root`/`kind` (root None: nothing is written or read)."""

    def __init__(self, root: str | Path | None, kind: str) -> None:
        self.dir = Path(root) / kind if root is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._last = 0  # the last modification time given, in ns: each use gets a later one

    def _stamp(self, path: Path) -> None:
        """Mark a use: a modification time after every one given before (a file system's clock may not tick
        between two uses)."""
        self._last = max(time.time_ns(), self._last + 1)
        os.utime(path, ns=(self._last, self._last))

    def _path(self, key: str) -> Path | None:
        if self.dir is None or not _NAME.fullmatch(key):
            return None
        return self.dir / f"{key}.json"

    def save(self, key: str, value: dict[str, Any]) -> None:
        path = self._path(key)
        if path is None:
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(value, f, ensure_ascii=False)
            os.replace(tmp, path)
            self._stamp(path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def touch(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._stamp(path)

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """(key, value) of every entry, least recently used first."""
        if self.dir is None:
            return []
        stamped = []
        for p in self.dir.glob("*.json"):
            if _NAME.fullmatch(p.stem):
                with contextlib.suppress(FileNotFoundError):  # gone since the listing
                    stamped.append((p.stat().st_mtime_ns, p.name, p))
        stamped.sort()
        if stamped:
            self._last = max(self._last, stamped[-1][0])
        out = []
        for _, _, p in stamped:
            try:
                value = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                log.warning("left %s out of the store: it does not read as JSON (%s)", p, e)
                continue
            if isinstance(value, dict):
                out.append((p.stem, value))
            else:
                log.warning("left %s out of the store: it is not a JSON object", p)
        return out
