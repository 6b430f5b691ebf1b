"""The process group of tensor parallelism: torchrun's, or one of world size 1 when not under torchrun.

`init_parallel()` initialises torch.distributed once per process from torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL when CUDA is present, gloo on the CPU. Outside
torchrun it makes a 1-rank gloo group over an in-process store, so a group always exists and callers
never ask whether they are distributed. Every collective has a timeout (POCKETMOE_TP_TIMEOUT_S, default
20 s): a rank that dies or hangs makes the others fail within it instead of waiting forever.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pocketmoe.errors import PocketMoEError

DEFAULT_TIMEOUT_S = 20.0


class RankLost(PocketMoEError):
    """A collective failed or timed out: another rank died or stopped answering."""


@dataclass
class CommStats:
    """Time the caller spent in all-reduces (issue to completion, what was not hidden behind other work)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


class Pending:
    """An all-reduce issued with async_op=True; wait() returns the reduced tensor."""

    def __init__(self, tp: Parallel, work: object, t: torch.Tensor, t0: float) -> None:
        self.tp, self.work, self.t, self.t0 = tp, work, t, t0
        self.issue_s = time.perf_counter() - t0

    def wait(self) -> torch.Tensor:
        t1 = time.perf_counter()
        if self.work is not None:
            try:
                self.work.wait()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001  (gloo raises RuntimeError / DistBackendError)
                raise self.tp.lost(e) from e
        s = self.tp.stats
        s.seconds += self.issue_s + time.perf_counter() - t1
        s.calls += 1
        s.bytes += self.t.numel() * self.t.element_size()
        return self.t


class Parallel:
    """Rank and world of this process, and the collectives the parallel layers use."""

    def __init__(self, group: object, rank: int, world: int, local_rank: int, backend: str,
                 control: object, timeout_s: float) -> None:
        self.group, self.rank, self.world, self.local_rank = group, rank, world, local_rank
        self.backend = backend
        self.control = control  # a gloo group for the CPU-side step messages (None, the default group, on gloo)
        self.timeout_s = timeout_s
        self.stats = CommStats()

    @property
    def is_lead(self) -> bool:
        """Rank 0: the one that runs the server / CLI and broadcasts each step."""
        return self.rank == 0

    def _group_for(self, t: torch.Tensor) -> object:
        """NCCL for device tensors, the gloo control group for host ones (CPU ops on a CUDA machine)."""
        return self.group if t.is_cuda or self.control is None else self.control

    def lost(self, e: BaseException) -> RankLost:
        return RankLost(f"rank {self.rank} of {self.world}: a collective failed ({str(e).splitlines()[0][:200]}); "
                        "another rank died or stopped answering within "
                        f"{self.timeout_s:g} s (POCKETMOE_TP_TIMEOUT_S).")

    def all_reduce_async(self, t: torch.Tensor) -> Pending:
        """Sum t over the ranks, in place, issued async; the caller does independent work, then wait()s."""
        t0 = time.perf_counter()
        if self.world == 1:
            return Pending(self, None, t, t0)
        try:
            work = dist.all_reduce(t, group=self._group_for(t), async_op=True)
        except Exception as e:  # noqa: BLE001
            raise self.lost(e) from e
        return Pending(self, work, t, t0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_async(t).wait()

    def all_gather_cols(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """[L, n_r] per rank, n_r the size of rank r's split_range(total) -> [L, total] on every rank."""
        if self.world == 1:
            return t
        from pocketmoe.parallel.linear import split_range

        sizes = [b - a for a, b in (split_range(total, self.world, r) for r in range(self.world))]
        width = max(sizes)  # all_gather takes equal shapes: pad to the widest share, then drop the padding
        if t.shape[1] < width:
            t = torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        try:
            dist.all_gather(parts, t.contiguous(), group=self._group_for(t))
        except Exception as e:  # noqa: BLE001
            raise self.lost(e) from e
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """t from rank 0 to every rank, in place (on the control group)."""
        if self.world > 1:
            try:
                dist.broadcast(t, 0, group=self.control)
            except Exception as e:  # noqa: BLE001
                raise self.lost(e) from e
        return t

    def ack(self) -> None:
        """A one-value all-reduce on the control group: every rank is still there."""
        if self.world > 1:
            try:
                dist.all_reduce(torch.ones(1, dtype=torch.int64), group=self.control)
            except Exception as e:  # noqa: BLE001
                raise self.lost(e) from e

    def agree(self, ok: bool) -> bool:
        """Whether every rank says ok (a one-value MIN all-reduce on the control group)."""
        if self.world == 1:
            return ok
        t = torch.tensor([int(ok)], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except Exception as e:  # noqa: BLE001
            raise self.lost(e) from e
        return bool(t.item())


_current: Parallel | None = None


def timeout_seconds() -> float:
    raw = os.environ.get("POCKETMOE_TP_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise PocketMoEError(f"POCKETMOE_TP_TIMEOUT_S is {raw!r}; give a number of seconds > 0.")
    return v


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_parallel() -> Parallel:
    """This process's group (made on the first call): torchrun's when launched by it, else world size 1."""
    global _current
    if _current is not None:
        return _current
    timeout_s = timeout_seconds()
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        backend = str(dist.get_backend())
    elif under_torchrun():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timeout)
    else:
        backend = "gloo"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    # group None: the default group (holding its object past destroy_process_group aborts the interpreter's exit)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    _current = Parallel(None, rank, world, int(os.environ.get("LOCAL_RANK", "0")), backend, control,
                        timeout_s)
    return _current


def rank() -> int:
    """This process's rank (0 outside torchrun)."""
    return init_parallel().rank


def world_size() -> int:
    """Ranks in the group: the tensor-parallel size (1 outside torchrun)."""
    return init_parallel().world


def shutdown_parallel() -> None:
    """Destroy the process group (at exit; after it no collective may run)."""
    global _current
    if _current is not None:
        _current.group = _current.control = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = None
