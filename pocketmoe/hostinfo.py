"""Facts about the host the engine runs on: memory, cores, and measured memory read bandwidth."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Bandwidth:
    gbps: float          # GB/s (1e9 bytes) of streaming reads
    threads: int
    bytes_read: int
    method: str


def host_memory_bytes() -> int:
    """MemTotal from /proc/meminfo (bytes); os.sysconf as the fallback."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def physical_cores() -> int:
    """Cores this process may run on (affinity), the usual choice for compute threads."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def measure_read_bandwidth(threads: int | None = None, size_mib: int = 512, repeats: int = 5) -> Bandwidth:
    """Streaming-read bandwidth: best of `repeats` full reductions over a buffer larger than cache."""
    import torch  # here, so reading host facts does not load torch

    threads = threads or physical_cores()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mib * (1 << 20) // 4, dtype=torch.float32)
        buf.sum()  # first touch and warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        nbytes = buf.numel() * 4
        return Bandwidth(nbytes / best / 1e9, threads, nbytes, f"torch.sum over {size_mib} MiB, best of {repeats}")
    finally:
        torch.set_num_threads(old)
