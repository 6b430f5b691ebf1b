"""The op set models are written in, with interchangeable backends.

Ops (each a method of a backend object; a model calls them through the layers it is built from):
  linear, linear_multi (weights sharing an input: the activation quantized once), batched (per-head
  weights), embed, rms_norm, add_rms_norm (with the residual add), finalize (routed + shared +
  residual, then the next sublayer's norm), rope (normal / NeoX, partial; YaRN lives in the tables),
  mla_attention (absorbed and legacy layouts; GQA and the DeepSeek-V4 kinds plug in beside it),
  route (softmax, sigmoid with selection bias, group-limited top-k, weight norm and scale),
  moe (over an ExpertBank), ffn (gated MLP: dense FFN and shared experts); and the sublayers composed
  of them, each closing with the residual update (layers.norm.Residual): mla_sublayer, moe_sublayer,
  ffn_sublayer. The reference defines a sublayer as its fine ops in order; the native backend runs it
  as one call (a decode layer is two), bitwise the same.

Backends: `reference` (plain torch, ops/reference.py) and `native` (the C++ CPU ops, ops/cpu.py, which
fall back to the reference per op for what they cannot take). A CUDA backend is one more subclass
registered in BACKENDS, with the same methods on device tensors: `cuda` (ops/cuda, CuPy; only
selectable where CuPy and a CUDA device are present).
"""

from __future__ import annotations

from pocketmoe.errors import PocketMoEError
from pocketmoe.ops.reference import ReferenceOps

BACKENDS = ("auto", "native", "reference", "cuda")


def make_ops(name: str = "auto", threads: int | None = None, tile_rows: int | None = 8) -> ReferenceOps:
    """The op backend: "auto" takes native when it is built and this CPU can run it."""
    if name not in BACKENDS:
        raise PocketMoEError(f"backend {name!r} is not one of {', '.join(BACKENDS)}.")
    if name == "cuda":  # only when asked for: "auto" stays on the CPU backends
        from pocketmoe.ops import cuda

        if not cuda.available():
            raise PocketMoEError(f"--backend cuda was asked for but {cuda.unavailable_reason()}; use native.")
        return cuda.make_cuda_ops(tile_rows)
    from pocketmoe import native

    if name == "reference" or (name == "auto" and not native.available()):
        ops = ReferenceOps(tile_rows)
        ops.detail = "torch reference" + ("" if name == "reference" else f" ({native.unavailable_reason()})")
        return ops
    if not native.available():
        raise PocketMoEError(f"--backend native was asked for but {native.unavailable_reason()}.")
    from pocketmoe.ops.cpu import NativeOps

    if threads is not None:
        native.set_num_threads(threads)
    ops = NativeOps(tile_rows)
    ops.detail = native.describe()
    return ops


__all__ = ["BACKENDS", "ReferenceOps", "make_ops"]
