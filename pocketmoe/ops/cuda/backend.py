"""The CUDA op backend: the kernels of src/ on device tensors, everything else on the reference.

`CudaOps` composes each op from kernel launches and a little torch glue (cat, views). QuantLinear runs
straight from its raw blocks (uploaded to the device once, on first use, kept in `backend_data`): the
activations quantized once per row (matmul.quantize_activations, shared by the weights of a linear_multi),
then the GEMV for up to GEMV_TOKENS tokens or the grouped GEMM (one group) beyond; per-head weights
(k_b / v_b) run as one grouped GEMM with a group per head. Small float vectors (norm weights, biases) get a
device copy made once; the embedding rows are looked up on the host and uploaded ([T, D] per step). A launcher runs a kernel: `CupyLauncher` compiles the sources with
CuPy `RawModule` (NVRTC) and launches on torch's current stream (`cupy.cuda.ExternalStream`), torch tensors
in and out by data_ptr; the tests hand CudaOps the CPU shim's launcher instead, so the same glue runs
here without a GPU. The attention kernels read f32, f16 and bf16 KV caches. An op the kernels do not take
(another dtype, a legacy MLA layout, dims past the kernels' limits) runs on the reference, on the same device. Importing this module imports no CuPy.

Legend: T tokens, H heads, G KV heads, C kv_lora, R rope dims, E experts, K experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.experts import NativeExperts, ReferenceExperts, combine
from pocketmoe.layers.moe import GATING_SOFTMAX, WEIGHT_SUM_MIN
from pocketmoe.ops.cuda import matmul
from pocketmoe.ops.cuda.graphs import made_once
from pocketmoe.ops.reference import ReferenceOps

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext
    from pocketmoe.layers.attention import MLAttention
    from pocketmoe.layers.experts import ExpertBank
    from pocketmoe.layers.gqa import GQAttention
    from pocketmoe.layers.linear import QuantEmbedding, QuantLinear
    from pocketmoe.layers.mlp import GatedMLP
    from pocketmoe.layers.moe import MoEBlock, Router
    from pocketmoe.layers.norm import Residual

# launch(source, kernel, grid, block, args, shared_mem): args are tensors (pointers), ints and floats
Launcher = Callable[[str, str, tuple[int, int, int], tuple[int, int, int], Sequence[Any], int], None]

ROW_THREADS = 256  # norms and finalize: one block per row
ROPE_THREADS = 128
ATT_THREADS = 128
ATT_VACC = 4  # attention.cu: value dims per thread, so value dims <= ATT_VACC * ATT_THREADS
ATT_HEADS = 16  # attention.cu: heads of one block at most (those that read the same key rows)
ATT_QUERY_BYTES = 40 << 10  # a block's queries in shared memory at most (its static arrays take 4.6 KiB of 48)
ATT_TILE = 64  # attention.cu: keys per tile
ATT_MIN_TILES = 2  # a span of keys (one block's) is at least this many tiles: 128 keys
ATT_MAX_SPANS = 32  # and a token's keys split into at most this many spans
ATT_PART_BYTES = 64 << 20  # the span partials of one launch at most (a long prefill's tokens go in groups)
# attention.cu's kv_type of each KV cache dtype (the values the cache stores; the arithmetic is float32)
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)


_PACK = {"int": np.int32, "long long": np.int64, "float": np.float32}  # a scalar parameter kind -> its packing


def attention_spans(n_keys: int, min_tiles: int = ATT_MIN_TILES, max_spans: int = ATT_MAX_SPANS) -> int:
    """attention.cu's spans_of: how many spans (blocks per head) a token of n_keys keys splits into."""
    tiles = -(-n_keys // ATT_TILE)
    per = max(min_tiles, -(-tiles // max_spans))
    return max(1, -(-tiles // per))


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
    """src/ kernels compiled once per source and device with CuPy RawModule, launched on torch's stream.

    The hot path is one dict lookup for the kernel (its RawKernel and how each parameter is packed, kept per
    source, kernel and device: RawModule.get_function would make a new RawKernel and look the function up in the
    driver at every call), the arguments packed, and the launch with the stream passed to it (no stream or device
    context to enter and leave)."""

    def __init__(self) -> None:
        import cupy

        from pocketmoe.ops.cuda.compile import SRC, cuda_include_dir

        self.cp = cupy
        self.src = SRC
        inc = cuda_include_dir()
        self.options = ("--std=c++17", f"-I{SRC}") + ((f"-I{inc}",) if inc else ())
        self._modules: dict[tuple[str, int], tuple[Any, dict[str, list[str]]]] = {}
        self._kernels: dict[tuple[str, str, int], tuple[Any, list[Any]]] = {}  # -> (RawKernel, packers)
        self._streams: dict[int, Any] = {}  # torch stream handle -> its cupy ExternalStream
        self._ptr_arrays: dict[tuple[int, ...], torch.Tensor] = {}  # addresses -> their device vector

    def _module(self, source: str, device: int) -> tuple[Any, dict[str, list[str]]]:
        key = (source, device)
        if key not in self._modules:
            text = (self.src / source).read_text()
            with self.cp.cuda.Device(device):
                self._modules[key] = (self.cp.RawModule(code=text, options=self.options), kernel_params(text))
        return self._modules[key]

    def _kernel(self, source: str, kernel: str, device: int) -> tuple[Any, list[Any]]:
        key = (source, kernel, device)
        got = self._kernels.get(key)
        if got is None:
            module, params = self._module(source, device)
            if kernel not in params:
                raise TypeError(f"{source} has no kernel {kernel}; it has {', '.join(sorted(params))}")
            with self.cp.cuda.Device(device):
                fn = module.get_function(kernel)  # compiles the module on first use, loads it on this device
            packers = [None if kind == "ptr" else _PACK[kind] for kind in params[kernel]]
            got = self._kernels[key] = (fn, packers)
        return got

    def _stream(self) -> Any:
        handle = torch.cuda.current_stream().cuda_stream
        got = self._streams.get(handle)
        if got is None:
            got = self._streams[handle] = self.cp.cuda.ExternalStream(handle)
        return got

    def __call__(self, source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: Sequence[Any], shared_mem: int = 0) -> None:
        device = torch.cuda.current_device()
        fn, packers = self._kernel(source, kernel, device)
        if len(packers) != len(args):
            raise TypeError(f"{kernel} takes {len(packers)} arguments, {len(args)} were given")
        packed = []
        for i, (pack, a) in enumerate(zip(packers, args, strict=True)):
            if pack is not None:
                packed.append(pack(a))
                continue
            if isinstance(a, (list, tuple)):  # pointer array: a device vector of addresses
                if not all(t.is_cuda for t in a):
                    raise TypeError(f"{kernel} argument {i}: a pointer array of tensors not all on the GPU")
                a = self._pointer_array(tuple(t.data_ptr() for t in a), device)
            elif not a.is_cuda:  # a host address would be read as a device one
                raise TypeError(f"{kernel} argument {i} is a {a.device} tensor; the kernels read GPU memory")
            packed.append(np.uint64(a.data_ptr()))
        fn(tuple(grid), tuple(block), tuple(packed), shared_mem=shared_mem, stream=self._stream())

    def _pointer_array(self, ptrs: tuple[int, ...], device: int) -> torch.Tensor:
        """The device vector of these addresses, made once (a slot pool's or a bank's list repeats every step).
        The vector holds only the addresses, so a stale entry after a tensor is freed is never wrong."""
        key = (device, *ptrs)
        got = self._ptr_arrays.get(key)
        if got is None:
            if len(self._ptr_arrays) >= 4096:
                self._ptr_arrays.clear()
            got = self._ptr_arrays[key] = torch.tensor(ptrs, dtype=torch.int64).to(f"cuda:{device}")
        return got


def _f32(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.float32 for t in ts)


def _alike(a: QuantLinear, b: QuantLinear) -> bool:
    """2-D weights one matmul can read as one: the same type and columns (the stacked rows read the same
    activations)."""
    return (a.ggml_type == b.ggml_type and len(a.shape) == 2 and len(b.shape) == 2
            and a.in_features == b.in_features)


class CudaOps(ReferenceOps):
    name = "cuda"
    absorbs_legacy_mla = True  # attn_kv_b is split into k_b / v_b at load: attention runs in latent space
    dense_cache_roles = ()     # the kernels read raw blocks: no dequantized float copies
    detail = "CUDA kernels (CuPy RawModule)"
    att_min_tiles = ATT_MIN_TILES  # attention.cu's key spans (the tests set smaller ones on an instance)
    att_max_spans = ATT_MAX_SPANS
    att_heads = ATT_HEADS  # heads of one attention block at most

    def __init__(self, tile_rows: int | None = 8, launcher: Launcher | None = None,
                 device: torch.device | str | None = None) -> None:
        """device: where the tensors live (default: torch's current CUDA device with the CuPy launcher, the CPU
        with any other launcher, e.g. the shim's)."""
        super().__init__(tile_rows)
        self.launch: Launcher = launcher if launcher is not None else CupyLauncher()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if launcher is None else torch.device("cpu")
        self.device = torch.device(device)
        self.device_name = f"{self.device.type}:{self.device.index or 0}"  # the plan's name of self.device
        # the plan's device of each layer and of the head (place_layers); empty: everything on self.device
        self._layers: list[tuple[str, torch.device]] = []
        self._head: tuple[str, torch.device] | None = None
        self.placed: dict[str, str] = {}  # weight name -> the device name its raw blocks were uploaded to
        self._step: tuple[object, tuple[torch.Tensor, ...]] = (None, ())
        # (id(host vector), device) -> (it, its device copy)
        self._vectors: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}  # _head_groups
        self._heads: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # id(w) -> (w, its per-head views)
        # ids of alike layers -> (them, _stacked's blocks): an FFN's gate and up, MLA's q and kv_a, ...
        self._stacks: dict[tuple[int, ...], tuple[tuple[QuantLinear, ...], torch.Tensor | bool]] = {}
        self.graphs: Any = None  # graphs.DecodeGraphs when CUDA graphs are on (enable_graphs)
        # the sublayer input (a finalize's y, or the MoE sublayer's x), its quantizations so far (block -> _acts'
        # list; a sublayer reads its input and writes only the residual stream, so they hold until the next
        # finalize) and the norm weight that made it (None: not a finalize's)
        self._input: tuple[torch.Tensor, dict[int, list[torch.Tensor]], torch.Tensor | None] | None = None
        # id(norm weight) -> (it, the activation block its sublayer's matmuls read): finalize quantizes for it
        self._norm_blocks: dict[int, tuple[torch.Tensor, int]] = {}
        self._ctx: StepContext | None = None  # the step run() is running

    # -- where each layer runs: a model split by layer over several GPUs ---------------------------
    def place_layers(self, layers: Sequence[str], head: str) -> None:
        """Each layer's weights and kernels go to its plan device, the head's to the head's: the weights upload
        at first use on the device that is current then (enter_layer / enter_head make it so)."""
        from pocketmoe.placement.plan import torch_device

        self._layers = [(n, torch_device(n)) for n in layers]
        self._head = (head, torch_device(head))
        if self.graphs is not None and len({d for _, d in (*self._layers, self._head)}) > 1:
            self.graphs = None  # a graph is captured on one device
            self.detail = self.detail.replace("graphs on", "graphs off: the model spans several GPUs")
        if self._layers:
            self._use(*self._layers[0])

    def _use(self, name: str, device: torch.device) -> None:
        self.device_name = name
        if device != self.device:
            self.device = device
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the launcher launches on the current device's stream

    def enter_layer(self, layer: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._layers:
            self._use(*self._layers[layer])
        return tuple(self._here(t) for t in ts)

    def enter_head(self, x: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            self._use(*self._head)
        return self._here(x)

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        """t on the current device (t itself when it is there: no op dispatched, which costs on the hot path)."""
        return t if t.device == self.device else t.to(self.device)

    # -- placement of what the kernels read --------------------------------------------------------
    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A weight-like tensor (norm weight, bias) on the current device: a copy made once per tensor and device."""
        if t.device == self.device:
            return t
        key = (id(t), self.device)
        got = self._vectors.get(key)
        if got is None or got[0] is not t:
            got = self._vectors[key] = (t, t.to(self.device).contiguous())
        return got[1]

    def weight(self, layer: QuantLinear) -> torch.Tensor | bool:
        """The layer's raw blocks on the device, uint8 [*lead, O, row_bytes], uploaded at first use; False when
        no kernel reads them (another type, columns not a multiple of the type's activation block)."""
        h = layer.backend_data
        if h is None:
            h = layer.backend_data = self._upload(layer)
        return h

    def _upload(self, layer: QuantLinear) -> torch.Tensor | bool:
        t, cols = layer.ggml_type, layer.in_features
        bv = matmul.activation_block(t)
        if not bv or cols % bv or len(layer.shape) not in (2, 3):
            return False
        raw = layer.raw
        if raw.is_floating_point():  # an F32 / F16 / BF16 view: the kernels read its bytes
            if raw.dtype != {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}.get(t):
                return False
            raw = raw.contiguous().view(torch.uint8)
        raw = raw.reshape(*layer.shape[:-1], -1)
        if layer.name:
            self.placed[layer.name] = self.device_name
        return raw.to(self.device).contiguous()

    def _acts(self, x: torch.Tensor, block: int) -> list[torch.Tensor]:
        """x quantized for `block`-value weights, once per sublayer input (`_input`): the MoE input once for the
        routed and the shared experts, and a finalize's y by the finalize itself once a step has shown which
        block size its sublayer's matmuls read."""
        known = self._input
        if known is None or x is not known[0]:
            return matmul.quantize_activations(self.launch, self._here(x), block)
        got = known[1].get(block)
        if got is None:
            got = known[1][block] = matmul.quantize_activations(self.launch, self._here(x), block)
            norm = known[2]
            if norm is not None and block > 1:  # the next finalize with this norm quantizes its y for `block`
                self._norm_blocks[id(norm)] = (norm, block)
        return got

    def _matmul(self, w: torch.Tensor, layer: QuantLinear, acts: list[torch.Tensor]) -> torch.Tensor:
        """y [T, O] from quantized activations: the GEMV for a few tokens, the one-group GEMM beyond (the same
        lane order, so the same bits either way)."""
        t = acts[0].shape[0]
        if t <= matmul.GEMV_TOKENS:
            return matmul.gemv(self.launch, w, layer.ggml_type, layer.in_features, acts)
        dev = self.device
        out = torch.empty((t, w.shape[0]), dtype=torch.float32, device=dev)
        offsets = torch.arange(0, 2 * t, t, dtype=torch.int32, device=dev)  # [0, t]
        tokens = torch.arange(t, dtype=torch.int32, device=dev)
        slots = torch.zeros(t, dtype=torch.int32, device=dev)
        return matmul.moe_gemm(self.launch, [w], layer.ggml_type, w.shape[0], layer.in_features, offsets, tokens,
                               slots, acts, 1, out, max_pairs=t)

    def _host_linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """A weight no kernel reads: the reference on the host, the result back on x's device."""
        return ReferenceOps.linear(self, layer, x.cpu().float()).to(x.device)

    # -- linear ------------------------------------------------------------------------------------
    def linear(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, O]
        w = self.weight(layer)
        if w is False or len(layer.shape) != 2:
            return self._host_linear(layer, x)
        return self._matmul(w, layer, self._acts(x, matmul.activation_block(layer.ggml_type)))

    def linear_multi(self, weights: Sequence[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
        """The input quantized once per activation block size the weights read; each run of alike weights (one type
        and column count: MLA's q and kv_a, GQA's q, k and v when their types agree) as one matmul over their rows
        stacked, the outputs its column slices (the bits of one matmul each: a row's sum does not depend on the
        rows beside it)."""
        acts: dict[int, list[torch.Tensor]] = {}
        out: list[torch.Tensor] = []
        i = 0
        while i < len(weights):
            j = i + 1
            while j < len(weights) and _alike(weights[i], weights[j]):
                j += 1
            run = tuple(weights[i:j])
            i = j
            w = self._stacked(run)
            if w is False:
                out += [self._host_linear(layer, x) for layer in run]
                continue
            bv = matmul.activation_block(run[0].ggml_type)
            if bv not in acts:
                acts[bv] = self._acts(x, bv)
            y = self._matmul(w, run[0], acts[bv])
            if len(run) == 1:
                out.append(y)
                continue
            at = 0
            for layer in run:  # a slice of one row is contiguous already (decode): no copy then
                out.append(y[:, at:at + layer.shape[0]].contiguous())
                at += layer.shape[0]
        return out

    def ffn(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x): gate and up as one matmul over their rows stacked (when they are alike), the
        product made as down's activations are quantized (one launch)."""
        w = self.weight(mlp.down)
        if w is False or len(mlp.down.shape) != 2 or mlp.gate.shape != mlp.up.shape:  # gu: two halves of F each
            return super().ffn(mlp, x)
        wgu = self._stacked((mlp.gate, mlp.up)) if _alike(mlp.gate, mlp.up) else False
        if wgu is not False:  # [T, 2F]: a row's gate, then its up
            gu = self._matmul(wgu, mlp.gate, self._acts(x, matmul.activation_block(mlp.gate.ggml_type)))
        else:
            gu = torch.cat([self._here(y) for y in self.linear_multi((mlp.gate, mlp.up), x)], dim=1)
        acts = matmul.quantize_swiglu(self.launch, gu, matmul.activation_block(mlp.down.ggml_type))
        return self._matmul(w, mlp.down, acts)

    def _stacked(self, layers: tuple[QuantLinear, ...]) -> torch.Tensor | bool:
        """The raw blocks of alike 2-D layers on the device, each layer's rows after the one before ([sum O,
        row_bytes]): one layer's own weight(), several uploaded once as one tensor in place of each (False when no
        kernel reads them)."""
        if len(layers) == 1:
            return self.weight(layers[0]) if len(layers[0].shape) == 2 else False
        key = tuple(id(layer) for layer in layers)
        got = self._stacks.get(key)
        if got is None or any(a is not b for a, b in zip(got[0], layers, strict=True)):
            parts = [self._upload(layer) for layer in layers]
            both = False if any(p is False for p in parts) else torch.cat(parts)
            got = self._stacks[key] = (layers, both)
        return got[1]

    def batched(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [H, T, I] -> [H, T, O]
        return self._per_head(layer, x.transpose(0, 1)).transpose(0, 1).contiguous()

    def _per_head(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:  # [T, H, I] -> [T, H, O]
        """One grouped GEMM, a group per head: pair (t, h) reads activation row t*H + h, writes row t*H + h."""
        w = self.weight(layer)
        t, h = x.shape[0], x.shape[1]
        if w is False or len(layer.shape) != 3:
            return ReferenceOps.batched(self, layer, x.transpose(0, 1).cpu().float()).transpose(0, 1).to(x.device)
        o, dev = layer.shape[1], self.device
        out = torch.empty((t * h, o), dtype=torch.float32, device=dev)
        if t == 0:
            return out.view(t, h, o)
        acts = self._acts(x.reshape(t * h, -1), matmul.activation_block(layer.ggml_type))
        offsets, tokens, slots = self._head_groups(t, h, dev)
        got = self._heads.get(id(w))
        if got is None or got[0] is not w:  # the pointer array's entries, made once per weight
            got = self._heads[id(w)] = (w, [w[i] for i in range(h)])
        matmul.moe_gemm(self.launch, got[1], layer.ggml_type, o, layer.in_features, offsets, tokens, slots, acts, h,
                        out, act_by_pair=True, max_pairs=t)
        return out.view(t, h, o)

    def _head_groups(self, t: int, h: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """offsets [H + 1], tokens [T*H], slots [T*H] of a per-head GEMM: group i holds the T pairs (t, i). Made
        once per (T, H, device); not kept when made while a CUDA graph is captured (its kernels have not run)."""
        if len(self._groups) >= 256:  # prefill chunks of many lengths
            self._groups.clear()
        return made_once(self._groups, (t, h, dev), lambda: (
            torch.arange(0, (h + 1) * t, t, dtype=torch.int32, device=dev),
            torch.arange(t, dtype=torch.int32, device=dev).repeat(h),
            torch.arange(h, dtype=torch.int32, device=dev).repeat_interleave(t)))

    def embed(self, table: QuantEmbedding, tokens: np.ndarray) -> torch.Tensor:  # [T] -> [T, D]
        """The rows looked up on the host (the table stays in host memory), uploaded."""
        if self.graphs is not None and self.graphs.inputs is not None:  # capturing: the rows through a static buffer
            ctx = self._ctx
            if ctx is None or tokens is not ctx.tokens:
                raise RuntimeError("embed of tokens other than the step's cannot be captured")
            return self.graphs.host_input(lambda c: ReferenceOps.embed(self, table, c.tokens), ctx)
        return super().embed(table, tokens).to(self.device)

    def moe(self, bank: ExpertBank, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A host bank (the CPU plan's) runs on host copies; the plan's device banks take device tensors. While a
        decode CUDA graph is captured only a resident bank may run (the dispatcher's cache bookkeeping would
        record copies the capture never makes): any other ends the capture before it changes anything."""
        if self.graphs is not None and self.graphs.inputs is not None:
            from pocketmoe.experts.resident import ResidentExperts

            if not isinstance(bank, ResidentExperts):
                raise RuntimeError(f"a {type(bank).__name__} MoE layer cannot be captured in a CUDA graph")
        if isinstance(bank, (NativeExperts, ReferenceExperts)) and x.device.type != "cpu":
            return bank(x.cpu(), ids.cpu(), weights.cpu()).to(x.device)
        return bank(x, ids, weights)

    def moe_sublayer(self, block: MoEBlock, x: torch.Tensor, residual: Residual) -> torch.Tensor | None:
        """ReferenceOps' MoE sublayer, its input quantized once for the routed and the shared experts (the sublayer
        reads x and writes only the residual stream, so x's quantization holds throughout). With the experts
        resident on the device, their combine runs in the finalize's launch (the same bits)."""
        from pocketmoe.experts.resident import ResidentExperts
        from pocketmoe.ops.cuda.experts import CudaExpertKernels

        if self._input is None or x is not self._input[0]:
            self._input = (x, {}, None)
        bank = block.experts
        if not isinstance(bank, ResidentExperts) or not isinstance(bank.kernels, CudaExpertKernels):
            return super().moe_sublayer(block, x, residual)
        weights, ids = self.route(block.router, x)
        contrib = self._here(bank.unweighted(x, ids))  # [T, K, D]
        shared = None if block.shared is None else self.ffn(block.shared, x)
        return self._finalize(residual.x, contrib, self._here(weights), shared, residual.norm, residual.eps)

    def run(self, model: Any, ctx: StepContext) -> torch.Tensor:
        """The step on the device (a captured CUDA graph when graphs are on and the step's shape has one);
        the logits come back to the host, as every backend returns them."""
        self._ctx = ctx
        if self._layers:
            self._use(*self._layers[0])  # the step's inputs go to the first layer's device
        try:
            if self.graphs is not None:
                out = self.graphs.run(model, ctx)
                if out is not None:
                    return out.cpu()
            return model(ctx).cpu()
        finally:
            self._ctx = None
            self._input = None

    def expert_kernels(self, device: torch.device) -> Any:
        """The routed-expert kernels for slot pools and resident banks on `device` (experts.build's hook)."""
        from pocketmoe.ops.cuda.experts import CudaExpertKernels

        return CudaExpertKernels(self.launch, self._acts)

    def _step_arrays(self, ctx: StepContext, device: torch.device) -> tuple[torch.Tensor, ...]:
        """seq, keys, page_table, write_rows (int32) and cos2, sin2 (float32) of the step on the device, made once
        per step (while a CUDA graph is captured: static buffers the graph copies from pinned ones)."""
        if self._step[0] is not ctx or self._step[1][0].device != device:
            capture = self.graphs is not None and self.graphs.inputs is not None

            def table(c: StepContext) -> np.ndarray:
                if not capture:
                    return c.page_table
                width = -(-c.cache.max_seq_len // c.cache.page)  # the widest a table gets: a fixed kernel argument
                t = np.zeros((c.page_table.shape[0], width), dtype=np.int32)
                t[:, :c.page_table.shape[1]] = c.page_table
                return t

            makes = [lambda c: c.seq, lambda c: c.keys, table, lambda c: c.write_rows]
            arrays = [self._step_input(lambda c, m=m: np.ascontiguousarray(m(c), dtype=np.int32), ctx, device)
                      for m in makes]
            arrays += [self._step_input(lambda c, n=n: getattr(c, n).float().contiguous(), ctx, device)
                       for n in ("cos2", "sin2")]
            self._step = (ctx, tuple(arrays))
        return self._step[1]

    def _step_input(self, make: Callable[[StepContext], Any], ctx: StepContext, device: torch.device) -> torch.Tensor:
        """make(ctx) on the device: through a graph's static buffers while one is captured, else a plain copy."""
        if self.graphs is not None:
            got = self.graphs.host_input(make, ctx)
            if got is not None:
                return got
        return torch.as_tensor(make(ctx)).to(device)

    def enable_graphs(self) -> bool:
        """CUDA graphs for decode steps (graphs.py); only on a CUDA device. Returns whether they are on."""
        from pocketmoe.ops.cuda.graphs import DecodeGraphs

        if self.device.type != "cuda":
            return False
        self.graphs = DecodeGraphs(self.device, reset=self._drop_step)
        return True

    def _drop_step(self) -> None:
        self._step = (None, ())

    # -- norms and the residual stream ---------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = weight.shape[-1]
        if not _f32(x, weight) or x.shape[-1] != d or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        x2 = x if x.dim() == 2 else x.contiguous().view(-1, d)
        y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            self.launch("norm_rope.cu", "rms_norm_f32", (x2.shape[0], 1, 1), (ROW_THREADS, 1, 1),
                        [x2, x2.stride(0), self.on_device(weight), y, d, d, float(eps)], 0)
        return y.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _f32(x, add, weight) or not x.is_contiguous() or add.shape != x.shape:
            return super().add_rms_norm(x, add, weight, eps)
        d = x.shape[-1]
        y = torch.empty_like(x)
        if x.numel():
            self.launch("norm_rope.cu", "add_rms_norm_f32", (x.numel() // d, 1, 1), (ROW_THREADS, 1, 1),
                        [x, add.contiguous(), self.on_device(weight), y, d, float(eps)], 0)
        return y

    def finalize(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | None:
        """x += a (+ b), then y = rms_norm(x) * weight, the next sublayer's input: quantized in the same launch
        (finalize_q8_0 / _q8_k) for the block size its matmuls read in an earlier step, which _acts then hands
        them."""
        return self._finalize(x, a, None, b, weight, eps)

    def _finalize(self, x: torch.Tensor, a: torch.Tensor, kw: torch.Tensor | None, b: torch.Tensor | None,
                  weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """finalize of a [T, D]; or, given kw [T, K], of the routed experts' unweighted outputs a [T, K, D] combined
        with those weights in the same launch (layers.experts.combine's bits)."""
        d = x.shape[-1]
        rows = x.numel() // d if d else 0
        if kw is None:
            fits = a.shape == x.shape
        else:
            fits = x.dim() == 2 and a.dim() == 3 and a.shape[::2] == x.shape and kw.shape == a.shape[:2] and _f32(kw)
        if not fits or not _f32(x, a, b, weight) or not x.is_contiguous() or (b is not None and b.shape != x.shape):
            self._input = None
            return super().finalize(x, a if kw is None else combine(a, kw), b, weight, eps)
        y = None if weight is None else torch.empty_like(x)
        known: dict[int, list[torch.Tensor]] = {}
        if x.numel():
            a = a.contiguous()
            args = [x, a, a if kw is None else kw.contiguous(), 0 if kw is None else a.shape[1],
                    a if b is None else b.contiguous(), 1 if b is None else 2]
            learned = None if weight is None else self._norm_blocks.get(id(weight))
            if learned is not None and learned[0] is weight and d % learned[1] == 0:
                block = learned[1]
                acts = known[block] = matmul.activation_buffers((rows, d), block, x.device)
                self.launch("finalize.cu", f"finalize_q8_{'0' if block == 32 else 'k'}", (rows, 1, 1),
                            (ROW_THREADS, 1, 1), [*args, self.on_device(weight), y, float(eps), d, *acts], 0)
            else:
                self.launch("finalize.cu", "finalize_f32", (rows, 1, 1), (ROW_THREADS, 1, 1),
                            [*args, x if weight is None else self.on_device(weight), x if y is None else y,
                             0 if weight is None else 1, d, float(eps)], 0)
        self._input = None if y is None else (y, known, weight)
        return y

    def _rope_into(self, y: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, neox: bool) -> None:
        """Rotate, in place, the leading R dims of every head of y [T, H, W] (contiguous)."""
        t, h, w = y.shape
        r = cos2.shape[-1]
        if t and r:
            self.launch("norm_rope.cu", "rope_f32", (t, 1, 1), (ROPE_THREADS, 1, 1),
                        [y, y, cos2.float().contiguous(), sin2.float().contiguous(), h * w, h, w, 0, r,
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
        if (not attn.absorbed or cache.dtype not in KV_TYPES or not _f32(q, kv)
                or c.kv_lora > ATT_VACC * ATT_THREADS):
            return super().mla_attention(attn, q, kv, ctx, layer)
        t, dev, width = q.shape[0], q.device, c.kv_lora + c.qk_rope
        write_rows, cos2, sin2 = self._step_arrays(ctx, dev)[3:]
        rows = cache.layer_rows(layer)  # [P, C+R]
        self.launch("attention.cu", "mla_latent_f32", (t, 1, 1), (ROW_THREADS, 1, 1),
                    [kv.contiguous(), self.on_device(attn.kv_a_norm.float()), cos2, sin2, write_rows, rows,
                     c.kv_lora, c.qk_rope, attn.eps, KV_TYPES[cache.dtype]], 0)
        q = q.contiguous()
        # the kernel reads each head's query as [k_b q_nope, rope(q_pe)]: the absorbed part from the per-head GEMM,
        # q_pe from q itself, rotated as it is loaded (no [T, H, C+R] buffer to copy both into, no rope launch)
        q_abs = self._per_head(attn.k_b, q.view(t, c.n_head, -1)[..., :c.qk_nope])  # [T, H, C]
        o_lat = torch.empty(t, c.n_head, c.kv_lora, dtype=torch.float32, device=dev)  # [T, H, C]
        self._attend("mla_attention_f32", ctx, q_abs, rows, o_lat, c.n_head,
                     [c.n_head, c.kv_lora, c.qk_rope, c.qk_nope, c.scale, KV_TYPES[cache.dtype]], width,
                     per_token=(q, cos2, sin2))
        return self._per_head(attn.v_b, o_lat).reshape(t, c.n_head * c.v_head)  # [T, H, V]

    def _attend(self, kernel: str, ctx: StepContext, q: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                shared: int, dims: list[Any], dk: int, per_token: Sequence[torch.Tensor] = ()) -> None:
        """out [T, H, Dv] = attention.cu's `kernel` for q (queries of dk floats a head) over the layer's cache
        rows, `shared` heads reading the same rows (in blocks of at most att_heads, whose queries fit
        ATT_QUERY_BYTES): a block per (heads, span, token), S spans enough for the step's longest token (for a
        captured graph, for the cache's longest, since replays run at other lengths); with S > 1 the partials
        [tokens, H, S, Dv + 2] are merged after, the tokens in groups whose partials fit ATT_PART_BYTES.
        per_token: more [T, ...] arguments, after q (sliced with it)."""
        t, n_head, dv = out.shape
        if not t:
            return
        seq, keys, table = self._step_arrays(ctx, q.device)[:3]
        per_block = max(1, min(self.att_heads, ATT_HEADS, shared, ATT_QUERY_BYTES // (dk * 4)))
        blocks = n_head // shared * -(-shared // per_block)
        capture = self.graphs is not None and self.graphs.inputs is not None
        longest = ctx.cache.max_seq_len if capture else int(ctx.keys.max())
        spans = attention_spans(longest, self.att_min_tiles, self.att_max_spans)
        group = t if spans == 1 else max(1, min(t, ATT_PART_BYTES // (n_head * spans * (dv + 2) * 4)))
        group = min(group, 65535)  # the grid's z extent
        part = out if spans == 1 else torch.empty(group * n_head * spans * (dv + 2), dtype=torch.float32,
                                                  device=q.device)
        split = [self.att_min_tiles, self.att_max_spans]
        for t0 in range(0, t, group):
            # the step's own tensors when one group takes every token (decode): a slice costs the host a few us
            qg, sg, kg, og, *xg = (q, seq, keys, out, *per_token) if group == t else \
                (x[t0:t0 + group] for x in (q, seq, keys, out, *per_token))
            n = og.shape[0]
            self.launch("attention.cu", kernel, (blocks, spans, n), (ATT_THREADS, 1, 1),
                        [qg, *xg, rows, sg, kg, table, table.shape[1], ctx.cache.page, og, part, *dims, per_block,
                         *split], per_block * dk * 4)
            if spans > 1:
                self.launch("attention.cu", "attention_merge_f32", (n_head, n, 1), (ATT_THREADS, 1, 1),
                            [part, kg, og, dv, spans, *split], 0)

    def gqa_attention(self, attn: GQAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                      layer: int) -> torch.Tensor:
        c, cache = attn.cfg, ctx.cache
        if cache.dtype not in KV_TYPES or not _f32(q, k, v) or c.v_dim > ATT_VACC * ATT_THREADS:
            return super().gqa_attention(attn, q, k, v, ctx, layer)
        t, dev = q.shape[0], q.device
        write_rows, cos2, sin2 = self._step_arrays(ctx, dev)[3:]
        qr = q.reshape(t, c.n_head, c.head_dim).contiguous().clone()
        kr = k.reshape(t, c.n_head_kv, c.head_dim).contiguous().clone()
        self._rope_into(qr, cos2, sin2, c.neox)
        self._rope_into(kr, cos2, sin2, c.neox)
        rows = cache.layer_rows(layer)  # [P, G*(Dh+Dv)]
        rows.index_copy_(0, write_rows.long(), torch.cat([kr.view(t, -1), v.reshape(t, -1)], dim=-1).to(rows.dtype))
        out = torch.empty(t, c.n_head, c.v_dim, dtype=torch.float32, device=dev)
        self._attend("gqa_attention_f32", ctx, qr, rows, out, c.n_head // c.n_head_kv,
                     [c.n_head, c.n_head_kv, c.head_dim, c.v_dim, c.scale, KV_TYPES[cache.dtype]], c.head_dim)
        return out.view(t, c.n_head * c.v_dim)

    # -- experts -------------------------------------------------------------------------------
    def route(self, router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = router.cfg
        logits = router.gate(x.float())  # [T, E]
        if not _f32(logits, router.bias):
            return super().route(router, x)
        logits = logits.contiguous()
        t = logits.shape[0]
        ids = torch.empty(t, c.top_k, dtype=torch.int64, device=x.device)  # as torch's topk gives them
        weights = torch.empty(t, c.top_k, dtype=torch.float32, device=x.device)
        if t:
            bias = router.bias
            self.launch("route.cu", "route_f32", (t, 1, 1), (32, 1, 1),
                        [logits, logits if bias is None else self.on_device(bias), int(bias is not None),
                         ids, weights, c.n_experts, c.top_k, 1 if c.gating == GATING_SOFTMAX else 2, c.n_groups,
                         c.groups_used, int(c.norm), float(c.scale), WEIGHT_SUM_MIN],
                        (2 * c.n_experts + c.n_groups) * 4)
        return weights, ids
