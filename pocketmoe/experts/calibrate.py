"""Start-up calibration of the cost model's rates: a short measurement on one layer's real experts.

Copy GB/s: one expert's raw blocks copied into a device slot. CPU GB/s: the host kernels on one token,
and per further token from a run of `batch` tokens; the device's from the device kernels on the slot.
Best of `repeats` each (a few ms on the tiny fixtures, ~0.1 s on V2-Lite shapes).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pocketmoe.experts.cost import GB, Rates
from pocketmoe.experts.kernels import ExpertKernels, ExpertStore
from pocketmoe.experts.staging import SlotPool


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _rates(kernels: ExpertKernels, store: ExpertStore, nbytes: int, hidden: int, batch: int, repeats: int,
           device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, hidden, generator=gen).to(device)
    zero = torch.zeros(batch, dtype=torch.int64, device=device)
    one = _best(lambda: kernels.outputs(store, x[:1], zero[:1]), repeats, sync)
    many = _best(lambda: kernels.outputs(store, x, zero), repeats, sync)
    per_token = max((many - one) / (batch - 1), one / batch)  # timer noise: at most batch-fold reuse
    return nbytes / GB / one, nbytes / GB / per_token


def calibrate(host: ExpertStore, host_kernels: ExpertKernels, pool: SlotPool, device_kernels: ExpertKernels,
              batch: int = 16, repeats: int = 3) -> Rates:
    """Rates measured on expert 0 of `host`, staged into slot 0 of `pool` (left empty afterwards)."""
    device = pool.store.gate.raw.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    nbytes = host.expert_bytes()
    hidden = host.gate.shape[2]

    def copy() -> None:
        pool.stage(0, 0)
        pool.acquire(0)
        pool.release(0)

    copy_s = _best(copy, repeats, sync)
    cpu, cpu_token = _rates(host_kernels, host, nbytes, hidden, batch, repeats, torch.device("cpu"), lambda: None)
    dev, dev_token = _rates(device_kernels, pool.store, nbytes, hidden, batch, repeats, device, sync)
    return Rates(nbytes / GB / copy_s, cpu, cpu_token, dev, dev_token)
