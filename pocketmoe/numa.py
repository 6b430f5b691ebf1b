"""NUMA placement of the routed experts kept in host memory.

On a host with several memory nodes (a two-socket server), the CPU reads the experts of every token: pages
that all sit on one node leave the other socket's memory channels idle and make its threads read across the
link. `--numa interleave` (what `auto` picks when the host has two or more memory nodes) spreads the expert
pages over the nodes, page by page, so every channel serves a share.

The experts are the memory-mapped file's pages (MAP_SHARED), and the kernel places a file page by the memory
policy of the thread that faults it in, not by mbind on the mapping (mbind(2)). So `place_experts` reads each
expert tensor's pages once, at load, under an interleaving policy on that thread (set_mempolicy(2)), then
puts the thread's policy back. Pages already in the page cache stay on the node they are on: the report
counts where a sample of them landed, and says to drop the page cache before the start for an even spread.

Linux only (the syscalls through libc); elsewhere, or where the syscalls are refused, nothing is placed and the
report says why.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pocketmoe.errors import PocketMoEError

NUMA_POLICIES = ("auto", "interleave", "off")
NODE_ROOT = Path("/sys/devices/system/node")
MPOL_DEFAULT, MPOL_INTERLEAVE = 0, 3
MPOL_F_NODE, MPOL_F_ADDR = 1 << 0, 1 << 1
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SAMPLE_PAGES = 4096  # pages whose node the report reads back
# (set_mempolicy, get_mempolicy) syscall numbers
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}


class NumaError(PocketMoEError):
    """A NUMA placement that was asked for cannot be made."""


def parse_node_list(text: str) -> list[int]:
    """The kernel's node-list format ("0", "0-3", "0,2-3") as a sorted list."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise NumaError(f"cannot read the node list {text.strip()!r}") from None
        nodes.update(range(lo, hi + 1))
    return sorted(nodes)


def memory_nodes(root: Path = NODE_ROOT) -> list[int]:
    """The NUMA nodes that have memory ([0] where sysfs does not say: one node)."""
    for name in ("has_memory", "online"):
        try:
            return parse_node_list((root / name).read_text()) or [0]
        except OSError:
            continue
    return [0]


class _Syscalls:
    def __init__(self) -> None:
        nums = _SYSCALLS.get(platform.machine())
        self.reason = None if nums is not None and os.name == "posix" else f"no NUMA syscalls on {platform.machine()}"
        self.set_nr, self.get_nr = nums or (0, 0)
        self.libc = ctypes.CDLL(None, use_errno=True) if self.reason is None else None

    def _call(self, what: str, nr: int, *args: Any) -> None:
        if self.libc is None or self.libc.syscall(nr, *args) != 0:
            err = ctypes.get_errno() if self.libc is not None else 0
            raise OSError(err, f"{what}: {os.strerror(err) if err else self.reason}")

    def set_policy(self, mode: int, nodes: Sequence[int]) -> None:
        mask, bits = _node_mask(nodes)
        self._call("set_mempolicy", self.set_nr, ctypes.c_int(mode), mask, ctypes.c_ulong(bits))

    def policy(self) -> tuple[int, list[int]]:
        """This thread's policy mode and node mask."""
        mode, (mask, bits) = ctypes.c_int(-1), _node_mask([])
        self._call("get_mempolicy", self.get_nr, ctypes.byref(mode), mask, ctypes.c_ulong(bits), None,
                   ctypes.c_ulong(0))
        return mode.value, [i for i in range(bits) if mask[i // 64] >> (i % 64) & 1]

    def node_of(self, address: int) -> int:
        """The node of the page at this address (faulting it in if it is not present)."""
        node = ctypes.c_int(-1)
        self._call("get_mempolicy", self.get_nr, ctypes.byref(node), None, ctypes.c_ulong(0),
                   ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR))
        return node.value


def _node_mask(nodes: Iterable[int]) -> tuple[Any, int]:
    words = 16  # 1024 nodes
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask, words * 64


SYSCALLS = _Syscalls()


@contextmanager
def interleaved(nodes: Sequence[int]) -> Iterator[None]:
    """This thread's new pages interleaved over `nodes` inside the block; the default policy after it."""
    SYSCALLS.set_policy(MPOL_INTERLEAVE, nodes)
    try:
        yield
    finally:
        SYSCALLS.set_policy(MPOL_DEFAULT, [])


@dataclass
class NumaReport:
    policy: str                        # the flag: auto | interleave | off
    nodes: list[int]                   # the host's memory nodes
    placed: bool = False               # the expert pages were read in under the interleaving policy
    bytes: int = 0                     # expert bytes read in
    sampled_pages_by_node: dict[int, int] = field(default_factory=dict)
    reason: str = ""                   # why nothing was placed, or what to know about the result

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "nodes": self.nodes, "placed": self.placed, "bytes": self.bytes,
                "sampled_pages_by_node": {str(k): v for k, v in sorted(self.sampled_pages_by_node.items())},
                "note": self.reason}


def _touch(a: np.ndarray) -> None:
    """Fault in every page of a (a read of one byte per page)."""
    flat = a.reshape(-1).view(np.uint8)
    int(flat[::PAGE].sum(dtype=np.uint64))


def _sample_nodes(arrays: Sequence[np.ndarray], total_pages: int, n_nodes: int) -> Counter[int]:
    """How many of about SAMPLE_PAGES evenly strided pages sit on each node (the stride is coprime with the node
    count, so a round-robin spread does not alias onto one node)."""
    step = max(1, total_pages // SAMPLE_PAGES)
    while math.gcd(step, max(n_nodes, 1)) != 1:
        step += 1
    got: Counter[int] = Counter()
    for a in arrays:
        base = a.ctypes.data
        for addr in range(-(-base // PAGE) * PAGE, base + a.nbytes, step * PAGE):
            got[SYSCALLS.node_of(addr)] += 1
    return got


def place_experts(arrays: Sequence[np.ndarray], policy: str = "auto", nodes: Sequence[int] | None = None
                  ) -> NumaReport:
    """Spread the pages of these host arrays (the routed experts' memory-mapped bytes) over the memory nodes, as
    the policy says: auto interleaves on two or more nodes, interleave always (on one node it is a no-op in
    effect), off never. `nodes`: the nodes to use (default: every node with memory)."""
    if policy not in NUMA_POLICIES:
        raise NumaError(f"--numa {policy!r} is not one of {', '.join(NUMA_POLICIES)}.")
    nodes = list(nodes) if nodes is not None else memory_nodes()
    report = NumaReport(policy, nodes)
    if policy == "off" or (policy == "auto" and len(nodes) < 2):
        report.reason = "off" if policy == "off" else "one memory node: nothing to spread"
        return report
    total = sum(a.nbytes for a in arrays)
    try:
        with interleaved(nodes):
            for a in arrays:
                _touch(a)
        report.sampled_pages_by_node = dict(_sample_nodes(arrays, -(-total // PAGE), len(nodes)))
    except OSError as e:
        if policy == "interleave":
            raise NumaError(f"--numa interleave could not set the memory policy ({e.strerror}); run without it "
                            "or with --numa off.") from None
        report.reason = f"not placed: {e.strerror}"
        return report
    report.placed, report.bytes = True, total
    if len(report.sampled_pages_by_node) < len(nodes) and len(nodes) > 1:
        report.reason = ("some expert pages were already in the page cache on one node and stay there; drop the "
                         "page cache (sync; echo 3 > /proc/sys/vm/drop_caches) before the start for an even spread")
    return report
