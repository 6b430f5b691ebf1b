"""Routed-expert kernels on the device (experts.kernels.ExpertKernels): a store's raw expert blocks (a device slot
pool or an all-device bank) read in place by the grouped GEMM of src/matmul.cu, one launch per weight.

A call's P (row, expert) pairs are grouped by expert on the device (a stable sort); every expert of the store is
one entry of the pointer array (an expert without pairs is an empty group), so the cached slots and the freshly
staged ones of a layer run in the same launches, whose grid takes only the non-empty groups when a step has few
pairs (a decode step's: at most P of the E). gate and up read the input rows (a token's row, whichever of
its K experts the pair is) quantized once per row; down reads silu(gate) * up, one row per pair, made as it is
quantized (one launch).
Each pair's output is unweighted ([P, D]); combine sums a token's K outputs in slot order in fp32, as the host
kernels do, in one launch. A store whose types have no kernel runs on the host.

Legend: P pairs, R input rows, D hidden, F expert FFN width, E experts (or slots) of the store, T tokens, K experts
per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from pocketmoe.experts.kernels import Activations, input_rows
from pocketmoe.layers.experts import combine
from pocketmoe.ops.cuda import matmul
from pocketmoe.ops.cuda.graphs import capturing

if TYPE_CHECKING:
    from pocketmoe.experts.kernels import ExpertStore
    from pocketmoe.layers.experts import ExpertWeights
    from pocketmoe.ops.cuda.backend import Launcher

COMBINE_THREADS = 256  # combine_f32: one block per token
SMALL_PAIRS = 64  # up to this many pairs: grouped by one kernel launch, the grid sized for P (no read-back)


def reads(store: ExpertStore) -> bool:
    """Whether the kernels read gate, up and down of this store (types with a kernel, column counts)."""
    for w in (store.gate, store.up, store.down):
        bv = matmul.activation_block(w.ggml_type)
        if not bv or w.shape[2] % bv or w.raw.is_floating_point():
            return False
    return True


def _as(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t on device as dtype; t itself when it already is (no op dispatched: host time on the hot path)."""
    return t if t.device == device and t.dtype == dtype else t.to(device, dtype)


class Grouping(NamedTuple):
    """A call's pairs grouped by expert (CudaExpertKernels.groups)."""
    offsets: torch.Tensor  # [n + 1] int32: where each expert's group starts
    order: torch.Tensor  # [P] int32: the pair indices, grouped
    tokens: torch.Tensor  # [P] int32: the input row of each grouped pair (order itself without rows)
    largest: int  # a bound on the largest group
    groups: torch.Tensor | None  # [m] int32: the non-empty groups then -1s, m = min(n, P) (None: every group runs)


class CudaExpertKernels:
    name = "cuda"

    def __init__(self, launch: Launcher,
                 quantize: Callable[[torch.Tensor, int], list[torch.Tensor]] | None = None) -> None:
        """quantize(x, block): the input rows' activations (CudaOps._acts, which shares them with the shared
        experts); default matmul.quantize_activations."""
        self.launch = launch
        self.quantize = quantize or (lambda x, block: matmul.quantize_activations(launch, x, block))
        # id(store) -> (store, per weight: the list of expert views the pointer array is made of)
        self._views: dict[int, tuple[ExpertStore, tuple[list[torch.Tensor], ...]]] = {}

    def _experts(self, store: ExpertStore) -> tuple[list[torch.Tensor], ...]:
        """The expert views of gate, up, down, and of gate then up (one launch over both)."""
        got = self._views.get(id(store))
        if got is None or got[0] is not store:
            gate, up, down = ([w.raw[e] for e in range(store.count)] for w in (store.gate, store.up, store.down))
            got = self._views[id(store)] = (store, (gate, up, down, gate + up))
        return got[1]

    def groups(self, which: torch.Tensor, n: int, rows: torch.Tensor | None = None, used: torch.Tensor | None = None,
               copies: int = 1) -> Grouping:
        """offsets [n + 1], order [P] (pair indices grouped by expert, in pair order within one) and tokens [P]
        (rows[order], the input row of each grouped pair; order itself without rows) as int32 on which's device
        (int64), and a bound on the largest group; used (an int64 counter) gains the non-empty groups. copies = 2
        (with rows) lays them out twice for one launch over two weights: offsets [2n + 1], order and tokens [2P],
        the second copy's offsets and order P further on; the first n + 1 / P entries are the one-copy arrays.

        Up to SMALL_PAIRS pairs (a decode step's) one launch sorts them, gathers the rows, counts the groups and
        lists the non-empty ones (route.cu group_pairs; torch's sort, counts and scan are a dozen ops of host
        overhead): the GEMM's grid takes min(n, P) groups a copy, not n, and P bounds the largest group (the
        tiles past a group's end exit at once, which costs less than the stream stall of a read-back). Beyond,
        torch's stable argsort, every group, and the largest group read back (one sync; while a CUDA graph is
        captured, P)."""
        dev, p = which.device, len(which)
        if copies not in (1, 2) or (copies == 2 and rows is None):
            raise ValueError(f"groups lays pairs out once, or twice given their rows; not {copies} times "
                             f"({'with' if rows is not None else 'without'} rows)")
        if rows is not None:
            rows = _as(rows, dev, torch.int32)
        if p <= SMALL_PAIRS:
            offsets = torch.zeros(copies * n + 1, dtype=torch.int32, device=dev) if p == 0 else \
                torch.empty(copies * n + 1, dtype=torch.int32, device=dev)
            order = torch.empty(copies * p, dtype=torch.int32, device=dev)
            tokens = order if rows is None else torch.empty(copies * p, dtype=torch.int32, device=dev)
            m = min(n, p)
            groups = torch.empty(copies * m, dtype=torch.int32, device=dev)
            if p:
                which = which.contiguous()
                self.launch("route.cu", "group_pairs", (1, 1, 1), (32, 1, 1),
                            [which, p, n, offsets, order, order if rows is None else rows.contiguous(),
                             int(rows is not None), tokens, which if used is None else used, int(used is not None),
                             copies, groups, m], 0)
            return Grouping(offsets, order, tokens, p, groups)
        order = torch.argsort(which, stable=True)
        counts = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, which, torch.ones_like(which))
        offsets = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        offsets[1:] = torch.cumsum(counts, 0)
        if used is not None:
            used += (counts > 0).sum()
        largest = p if capturing() else int(counts.max())
        order32 = order.to(torch.int32)
        tokens = order32 if rows is None else rows.index_select(0, order)
        if copies == 2:
            offsets, order32, tokens = (torch.cat([offsets, offsets[1:] + p]), torch.cat([order32, order32 + p]),
                                        torch.cat([tokens, tokens]))
        return Grouping(offsets, order32, tokens, largest, None)

    def outputs(self, store: ExpertStore, x: torch.Tensor | Activations, which: torch.Tensor,
                rows: torch.Tensor | None = None, used: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, D] float32, which [P] (expert or slot of `store`), rows [P] (pair p reads x[rows[p]]; None:
        row p) -> [P, D] float32, unweighted; used gains the distinct experts (kernels.count_used). x's rows are
        quantized once (once per layer call when x is an Activations shared by the calls), not once per pair."""
        dev = store.gate.raw.device
        p, d, f = len(which), store.down.shape[1], store.ffn
        if not reads(store):
            from pocketmoe.experts.kernels import ExpertStore, ReferenceKernels, count_used
            from pocketmoe.layers.experts import ExpertWeights

            count_used(which, store.count, used)
            host = ExpertStore(*(ExpertWeights(w.raw.cpu(), w.ggml_type, w.shape) for w in (store.gate, store.up, store.down)),
                               store.swiglu_limit)
            return ReferenceKernels(None).outputs(host, input_rows(x, rows).cpu().float(), which.cpu()).to(dev)
        out = torch.empty((p, d), dtype=torch.float32, device=dev)
        if p == 0:
            return out
        acts = x if isinstance(x, Activations) else Activations(x)
        if acts.x.device != dev:  # (quantize_activations makes the rows float32 and contiguous)
            acts = Activations(acts.x.to(dev))
        which = _as(which, dev, torch.int64)
        # one launch over gate and up when they are alike and the pairs' rows are given (the grouping laid out
        # twice: the second copy's output rows P further on); two launches into the halves of gu otherwise
        both = rows is not None and store.gate.ggml_type == store.up.ggml_type and store.gate.shape == store.up.shape
        # top_k 0: a pair's output row (tokens[p] * top_k + slots[p]) is slots[p], here its own index, the row of
        # h that down reads; gate and up read row tokens[p] of x, the pair's input row
        g = self.groups(which, store.count, rows, used, 2 if both else 1)
        gate, up, down, gate_up = self._experts(store)
        grouped = (g.offsets, g.tokens, g.order, g.groups)
        once = grouped  # the first copy
        if both:
            once = (g.offsets[:store.count + 1], g.tokens[:p], g.order[:p],
                    None if g.groups is None else g.groups[:len(g.groups) // 2])

        def gemm(experts: list[torch.Tensor], w: ExpertWeights, a: list[torch.Tensor], n_out: int, y: torch.Tensor,
                 by_pair: bool, arrays: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
            offsets, tokens, order, groups = arrays
            return matmul.moe_gemm(self.launch, experts, w.ggml_type, n_out, w.shape[2], offsets, tokens, order, a,
                                   0, y, act_by_pair=by_pair, max_pairs=g.largest, groups=groups)

        def x_acts(w: ExpertWeights) -> list[torch.Tensor]:
            key = (self.name, matmul.activation_block(w.ggml_type))
            if key not in acts.derived:
                acts.derived[key] = self.quantize(acts.x, key[1])
            return acts.derived[key]

        gu = torch.empty((2, p, f), dtype=torch.float32, device=dev)  # gate's outputs, then up's
        if both:
            gemm(gate_up, store.gate, x_acts(store.gate), f, gu.view(2 * p, f), False, grouped)
        else:
            gemm(gate, store.gate, x_acts(store.gate), f, gu[0], False, grouped)
            gemm(up, store.up, x_acts(store.up), f, gu[1], False, grouped)
        h_acts = matmul.quantize_swiglu(self.launch, gu, matmul.activation_block(store.down.ggml_type),  # h [P, F]
                                        store.swiglu_limit)
        return gemm(down, store.down, h_acts, d, out, True, once)

    def combine(self, contrib: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """contrib [T, K, D], weights [T, K] -> [T, D] float32 in slot order (on contrib's device): one launch of
        finalize.cu's combine_f32, the bits of layers.experts.combine (whose 2K - 1 torch ops are as many)."""
        dev = contrib.device
        w = _as(weights, dev, torch.float32)
        if contrib.dtype != torch.float32 or contrib.dim() != 3 or not contrib.shape[1] or w.shape != contrib.shape[:2]:
            return combine(contrib, w)
        t, k, d = contrib.shape
        y = torch.empty((t, d), dtype=torch.float32, device=dev)
        if t and d:
            self.launch("finalize.cu", "combine_f32", (t, 1, 1), (COMBINE_THREADS, 1, 1),
                        [contrib.contiguous(), w.contiguous(), y, k, d], 0)
        return y
