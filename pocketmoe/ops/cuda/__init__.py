"""The CUDA op backend: CUDA C sources in src/ on raw GGUF blocks and float activations, loaded with CuPy
RawModule and launched on torch's current stream (backend.CudaOps).

Checked without a GPU by two gates: compile.py (every source through NVRTC for sm_75/86/89/90, nvcc's
register / shared memory / spill report) and the CPU execution shim (pocketmoe.testing.cuda_shim) that runs
the same sources against the torch reference. Importing this package imports no CuPy.
"""

from __future__ import annotations

from functools import cache


@cache
def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (None when CuPy and a CUDA device are present)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA install
        return f"CuPy is not importable ({exc}); pip install cupy-cuda12x"
    return None


def available() -> bool:
    return unavailable_reason() is None


# Architectures whose every op CudaOps runs on device tensors (DeepSeek-V4's extra ops are the reference's, on
# host weights): others keep the CPU op backend, with their routed experts on the device banks.
ARCHITECTURES = ("deepseek2", "minimax-m2")


def plan_backend(backend: str, plan: object, architecture: str | None = None) -> str:
    """The op backend a runner takes for `plan`: "auto" becomes "cuda" when the plan puts the model on a CUDA
    device (mode all-device or heterogeneous) and CudaOps runs the architecture; anything else is left as asked."""
    devices = getattr(plan, "devices", ())
    on_cuda = getattr(plan, "mode", "cpu") != "cpu" and any(d.name.startswith("cuda") for d in devices)
    if backend != "auto" or not on_cuda or (architecture is not None and architecture not in ARCHITECTURES):
        return backend
    reason = unavailable_reason()
    if reason is not None:
        from pocketmoe.errors import PocketMoEError

        raise PocketMoEError(f"the plan runs on {devices[0].name} but {reason}; install CuPy or use --device cpu.")
    return "cuda"


def make_cuda_ops(tile_rows: int | None = 8):  # -> backend.CudaOps
    import torch

    from pocketmoe.ops.cuda.backend import CudaOps
    from pocketmoe.ops.cuda.graphs import GRAPHS_ENV, requested

    ops = CudaOps(tile_rows)
    graphs = requested() and ops.enable_graphs()
    ops.detail = (f"CUDA kernels on {torch.cuda.get_device_name()} (CuPy RawModule; decode CUDA graphs "
                  f"{'on' if graphs else f'off, {GRAPHS_ENV}=1 turns them on'})")
    return ops


__all__ = ["available", "make_cuda_ops", "plan_backend", "unavailable_reason"]
