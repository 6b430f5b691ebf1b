"""The CUDA op backend: the kernels of src/ on device tensors, everything else on the reference.

`CudaOps` composes each op from kernel launches and a little torch glue (cat, views, the per-head
GEMMs through the layers' own backend). A launcher runs a kernel: `CupyLauncher` compiles the sources with
CuPy `RawModule` (NVRTC) and launches on torch's current stream (`cupy.cuda.ExternalStream`), torch tensors
in and out by data_ptr; the tests hand CudaOps the CPU shim's launcher instead, so the same glue runs
here without a GPU. An op the kernels do not take (another dtype, an f16 cache, a legacy MLA layout, dims
past the kernels' limits) runs on the reference, on the same device. Importing this module imports no CuPy.

Legend: T tokens, H heads, G KV heads, C kv_lora, R rope dims, E experts, K experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.moe import GATING_SOFTMAX, WEIGHT_SUM_MIN
from pocketmoe.ops.reference import ReferenceOps

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.attention import MLAttention
    from pocketmoe.layers.gqa import GQAttention
    from pocketmoe.layers.moe import Router

# launch(source, kernel, grid, block, args, shared_mem): args are tensors (pointers), ints and floats
Launcher = Callable[[str, str, tuple[int, int, int], tuple[int, int, int], Sequence[Any], int], None]

ROW_THREADS = 256  # norms and finalize: one block per row
ROPE_THREADS = 128
ATT_THREADS = 128
ATT_ACC = 8  # attention.cu: value dims per thread, so value dims <= ATT_ACC * ATT_THREADS

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


def kernel_params(text: str) -> dict[str, list[str]]:
    """Each kernel's parameter kinds, from the source text: "ptr", "int", "long long" or "float"."""
    out = {}
    for name, params in _KERNEL.findall(text):
        kinds = []
        for p in params.split(","):
            p = p.strip()
            kinds.append("ptr" if "*" in p else "long long" if "long long" in p else "float" if "float" in p
                         else "int")
        out[name] = kinds
    return out


class CupyLauncher:
    """src/ kernels compiled once per source and device with CuPy RawModule, launched on torch's stream."""

    def __init__(self) -> None:
        import cupy

        from pocketmoe.ops.cuda.compile import SRC, cuda_include_dir

        self.cp = cupy
        self.src = SRC
        inc = cuda_include_dir()
        self.options = ("--std=c++17", f"-I{SRC}") + ((f"-I{inc}",) if inc else ())
        self._modules: dict[tuple[str, int], tuple[Any, dict[str, list[str]]]] = {}

    def _module(self, source: str, device: int) -> tuple[Any, dict[str, list[str]]]:
        key = (source, device)
        if key not in self._modules:
            text = (self.src / source).read_text()
            with self.cp.cuda.Device(device):
                self._modules[key] = (self.cp.RawModule(code=text, options=self.options), kernel_params(text))
        return self._modules[key]

    def __call__(self, source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: Sequence[Any], shared_mem: int = 0) -> None:
        device = torch.cuda.current_device()
        module, params = self._module(source, device)
        kinds = params[kernel]
        if len(kinds) != len(args):
            raise TypeError(f"{kernel} takes {len(kinds)} arguments, {len(args)} were given")
        keep, packed = [], []
        for kind, a in zip(kinds, args, strict=True):
            if kind == "ptr":
                if isinstance(a, (list, tuple)):  # pointer array: a device vector of addresses
                    a = torch.tensor([t.data_ptr() for t in a], dtype=torch.int64, device=f"cuda:{device}")
                    keep.append(a)
                packed.append(np.uint64(a.data_ptr()))
            else:
                packed.append({"int": np.int32, "long long": np.int64, "float": np.float32}[kind](a))
        stream = self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with self.cp.cuda.Device(device), stream:
            module.get_function(kernel)(tuple(grid), tuple(block), tuple(packed), shared_mem=shared_mem)


def _f32(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.float32 for t in ts)


class CudaOps(ReferenceOps):
    name = "cuda"
    absorbs_legacy_mla = True  # attn_kv_b is split into k_b / v_b at load: attention runs in latent space
    detail = "CUDA kernels (CuPy RawModule)"

    def __init__(self, tile_rows: int | None = 8, launcher: Launcher | None = None) -> None:
        super().__init__(tile_rows)
        self.launch: Launcher = launcher if launcher is not None else CupyLauncher()
        self._step: tuple[object, tuple[torch.Tensor, ...]] = (None, ())

    def _step_arrays(self, ctx: StepContext, device: torch.device) -> tuple[torch.Tensor, ...]:
        """seq, keys, page_table, write_rows of the step on the device (made once per step)."""
        if self._step[0] is not ctx or self._step[1][0].device != device:
            arrays = (ctx.seq, ctx.keys, ctx.page_table, ctx.write_rows)
            self._step = (ctx, tuple(torch.as_tensor(np.ascontiguousarray(a, dtype=np.int32), device=device)
                                     for a in arrays))
        return self._step[1]

    # -- norms and the residual stream ---------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = weight.shape[-1]
        if not _f32(x, weight) or x.shape[-1] != d or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        x2 = x if x.dim() == 2 else x.contiguous().view(-1, d)
        y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            self.launch("norm_rope.cu", "rms_norm_f32", (x2.shape[0], 1, 1), (ROW_THREADS, 1, 1),
                        [x2, x2.stride(0), weight.contiguous(), y, d, d, float(eps)], 0)
        return y.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _f32(x, add, weight) or not x.is_contiguous() or add.shape != x.shape:
            return super().add_rms_norm(x, add, weight, eps)
        d = x.shape[-1]
        y = torch.empty_like(x)
        if x.numel():
            self.launch("norm_rope.cu", "add_rms_norm_f32", (x.numel() // d, 1, 1), (ROW_THREADS, 1, 1),
                        [x, add.contiguous(), weight.contiguous(), y, d, float(eps)], 0)
        return y

    def finalize(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
        if (not _f32(x, a, b, weight) or not x.is_contiguous() or a.shape != x.shape
                or (b is not None and b.shape != x.shape)):
            return super().finalize(x, a, b, weight, eps)
        d = x.shape[-1]
        y = None if weight is None else torch.empty_like(x)
        if x.numel():
            a = a.contiguous()
            self.launch("finalize.cu", "finalize_f32", (x.numel() // d, 1, 1), (ROW_THREADS, 1, 1),
                        [x, a, a if b is None else b.contiguous(), 1 if b is None else 2,
                         x if weight is None else weight.contiguous(), x if y is None else y,
                         0 if weight is None else 1, d, float(eps)], 0)
        return y

    def _rope_into(self, y: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool, off: int = 0) -> None:
        """Rotate, in place, the R dims at `off` of every head of y [T, H, W] (contiguous)."""
        t, h, w = y.shape
        r = cos2.shape[-1]
        if t and r:
            self.launch("norm_rope.cu", "rope_f32", (t, 1, 1), (ROPE_THREADS, 1, 1),
                        [y, y, cos2.float().contiguous(), sin2.float().contiguous(), h * w, h, w, off, r,
                         int(neox)], 0)

    def rope(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool = False) -> torch.Tensor:
        if not _f32(x) or x.dim() != 3:
            return super().rope(x, cos2, sin2, neox)
        y = x.contiguous().clone()
        self._rope_into(y, cos2.to(x.device), sin2.to(x.device), neox)
        return y

    # -- attention -----------------------------------------------------------------------------
    def mla_attention(self, attn: MLAttention, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        c, cache = attn.cfg, ctx.cache
        if (not attn.absorbed or cache.data.dtype != torch.float32 or not _f32(q, kv)
                or c.kv_lora > ATT_ACC * ATT_THREADS):
            return super().mla_attention(attn, q, kv, ctx, layer)
        t, dev, width = q.shape[0], q.device, c.kv_lora + c.qk_rope
        seq, keys, table, write_rows = self._step_arrays(ctx, dev)
        cos2, sin2 = ctx.cos2.to(dev).float().contiguous(), ctx.sin2.to(dev).float().contiguous()
        rows = cache.data[layer]  # [P, C+R]
        self.launch("attention.cu", "mla_latent_f32", (t, 1, 1), (ROW_THREADS, 1, 1),
                    [kv.contiguous(), attn.kv_a_norm.float().contiguous(), cos2, sin2, write_rows, rows,
                     c.kv_lora, c.qk_rope, attn.eps], 0)
        q_nope, q_pe = q.view(t, c.n_head, -1).split([c.qk_nope, c.qk_rope], dim=-1)
        qcat = torch.empty(t, c.n_head, width, dtype=torch.float32, device=dev)  # [T, H, C+R]
        qcat[..., :c.kv_lora] = attn.k_b.batched(q_nope.transpose(0, 1).contiguous()).transpose(0, 1)
        qcat[..., c.kv_lora:] = q_pe
        self._rope_into(qcat, cos2, sin2, False, c.kv_lora)
        o_lat = torch.empty(t, c.n_head, c.kv_lora, dtype=torch.float32, device=dev)  # [T, H, C]
        self.launch("attention.cu", "mla_attention_f32", (t, c.n_head, 1), (ATT_THREADS, 1, 1),
                    [qcat, rows, seq, keys, table, table.shape[1], cache.page, o_lat, c.kv_lora, c.qk_rope,
                     c.scale], width * 4)
        o = attn.v_b.batched(o_lat.transpose(0, 1).contiguous())  # [H, T, V]
        return o.transpose(0, 1).reshape(t, c.n_head * c.v_head)

    def gqa_attention(self, attn: GQAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        c, cache = attn.cfg, ctx.cache
        if cache.data.dtype != torch.float32 or not _f32(q, k, v) or c.v_dim > ATT_ACC * ATT_THREADS:
            return super().gqa_attention(attn, q, k, v, ctx, layer)
        t, dev = q.shape[0], q.device
        seq, keys, table, write_rows = self._step_arrays(ctx, dev)
        cos2, sin2 = ctx.cos2.to(dev).float().contiguous(), ctx.sin2.to(dev).float().contiguous()
        qr = q.reshape(t, c.n_head, c.head_dim).contiguous().clone()
        kr = k.reshape(t, c.n_head_kv, c.head_dim).contiguous().clone()
        self._rope_into(qr, cos2, sin2, c.neox)
        self._rope_into(kr, cos2, sin2, c.neox)
        rows = cache.data[layer]  # [P, G*(Dh+Dv)]
        rows.index_copy_(0, write_rows.long(), torch.cat([kr.view(t, -1), v.reshape(t, -1)], dim=-1))
        out = torch.empty(t, c.n_head, c.v_dim, dtype=torch.float32, device=dev)
        self.launch("attention.cu", "gqa_attention_f32", (t, c.n_head, 1), (ATT_THREADS, 1, 1),
                    [qr, rows, seq, keys, table, table.shape[1], cache.page, out, c.n_head_kv, c.head_dim,
                     c.v_dim, c.scale], c.head_dim * 4)
        return out.view(t, c.n_head * c.v_dim)

    # -- experts -------------------------------------------------------------------------------
    def route(self, router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = router.cfg
        logits = router.gate(x.float())  # [T, E]
        if not _f32(logits, router.bias):
            return super().route(router, x)
        logits = logits.contiguous()
        t = logits.shape[0]
        ids = torch.empty(t, c.top_k, dtype=torch.int32, device=x.device)
        weights = torch.empty(t, c.top_k, dtype=torch.float32, device=x.device)
        if t:
            bias = router.bias
            self.launch("route.cu", "route_f32", (t, 1, 1), (32, 1, 1),
                        [logits, logits if bias is None else bias.to(x.device).contiguous(), int(bias is not None),
                         ids, weights, c.n_experts, c.top_k, 1 if c.gating == GATING_SOFTMAX else 2, c.n_groups,
                         c.groups_used, int(c.norm), float(c.scale), WEIGHT_SUM_MIN],
                        (2 * c.n_experts + c.n_groups) * 4)
        return weights, ids.long()
