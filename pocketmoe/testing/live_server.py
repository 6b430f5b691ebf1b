"""`python -m pocketmoe.serve` in a child process on a free port, for tests and benchmarks.

    with LiveServer(["--model", path]) as srv:
        httpx.get(srv.url + "/health")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

READY = re.compile(r"ready on (http://\S+)")


class LiveServer:
    def __init__(self, args: Sequence[str], timeout: float = 120.0, env: dict[str, str] | None = None,
                 launcher: Sequence[str] = ()) -> None:
        """launcher: what runs the module instead of this Python (e.g. torchrun's `python -m
        torch.distributed.run --nproc-per-node 2`)."""
        self.launcher = list(launcher) or [sys.executable]
        self.args = ["--port", "0", *args]
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.stdout: list[str] = []
        self.stderr: list[str] = []

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen([*self.launcher, "-m", "pocketmoe.serve", *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=self.env)
        ready = threading.Event()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout, ready), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr, None), daemon=True)]
        for t in self._readers:
            t.start()
        deadline = time.monotonic() + self.timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not get ready (exit {self.proc.returncode}):\n"
                                   + "".join(self.stderr[-30:]))

    def _read(self, stream: IO[str], lines: list[str], ready: threading.Event | None) -> None:
        for line in stream:
            lines.append(line)
            if ready is not None and (m := READY.search(line)):
                self.url = m.group(1)
                ready.set()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        for t in self._readers:
            t.join(2)
        return rc

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode
