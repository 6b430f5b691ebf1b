"""make_plan: all-device if everything fits, else routed experts in host memory, else a clear refusal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pocketmoe.cli_util import size
from pocketmoe.placement.estimate import decode_estimates
from pocketmoe.placement.inventory import EMBEDDING, ROUTED, ModelBytes, TensorLike, model_bytes
from pocketmoe.placement.plan import (
    GIB,
    DeviceAssignment,
    Devices,
    PlacementError,
    PlacementPlan,
    PlanOptions,
)
from pocketmoe.placement.reserve import KVReserve, Workspace, kv_reserve, workspace
from pocketmoe.placement.split import Piece, split_pieces


def spec_metadata(spec: Any) -> dict[str, Any]:
    """The `{arch}.*` hyperparameters of the spec's config as plain values."""
    meta = spec.metadata()
    return {k: getattr(v, "value", v) for k, v in meta.items()}


def _place(t: Any, layer_device: Mapping[int, int], n: int) -> int:
    if t.layer is not None:
        return layer_device[t.layer]
    return 0 if t.role == EMBEDDING else n - 1


def _pieces(mb: ModelBytes, kv: KVReserve, with_routed: bool) -> list[Piece]:
    keep = [t for t in mb.tensors if with_routed or t.role != ROUTED]
    embed = sum(t.nbytes for t in keep if t.layer is None and t.role == EMBEDDING)
    head = sum(t.nbytes for t in keep if t.layer is None and t.role != EMBEDDING)
    layers = [Piece(f"layer {i}", i, sum(t.nbytes for t in keep if t.layer == i) + kv.per_layer.get(i, 0))
              for i in range(mb.n_layers)]
    return [Piece("embedding", None, embed, "first"), *layers, Piece("head", None, head, "last")]


def _refuse_device(mb: ModelBytes, kv: KVReserve, ws: Workspace, devices: Devices, opts: PlanOptions,
                   pieces: list[Piece]) -> PlacementError:
    n = len(devices.gpus)
    ws_total = ws.activations * n + ws.context_overhead * n + ws.logits
    need = mb.non_expert + kv.total + ws_total
    have = sum(g.memory_bytes for g in devices.gpus)
    biggest = max(pieces, key=lambda p: p.nbytes)
    where = (f"{n} GPU(s) have {size(have)}" if need > have else
             f"the largest piece ({biggest.label}, {size(biggest.nbytes)}) does not fit the per-GPU "
             f"memory left of {', '.join(size(g.memory_bytes) for g in devices.gpus)}")
    return PlacementError(
        f"the non-expert weights ({size(mb.non_expert)}) plus the KV cache ({size(kv.total)} for "
        f"{opts.context_length} tokens x batch {opts.batch}) and workspace ({size(ws_total)}) need "
        f"{size(need)} on device but {where}; use more or larger GPUs, a shorter --context-length, a "
        f"smaller --batch, or --num-gpus 0 (--mode cpu) for CPU only.")


def _slots(mb: ModelBytes, layer_device: Mapping[int, int], free: list[int]) -> dict[int, int]:
    """Spread each GPU's free memory evenly as expert slots over its MoE layers (at most E per layer)."""
    out: dict[int, int] = {}
    size = mb.max_expert_bytes
    for g, f in enumerate(free):
        layers = [layer for layer in mb.moe_layers if layer_device.get(layer) == g]
        if not layers or size == 0:
            continue
        total = max(f, 0) // size
        for i, layer in enumerate(layers):
            out[layer] = min(total // len(layers) + (1 if i < total % len(layers) else 0), mb.n_experts)
    return {layer: out.get(layer, 0) for layer in mb.moe_layers}


def _fixed_slots(mb: ModelBytes, layer_device: Mapping[int, int], free: list[int], per_layer: int) -> dict[int, int]:
    """`per_layer` slots (at most E) on every MoE layer, refused where a device's free memory is short."""
    if per_layer < 0:
        raise PlacementError(f"--expert-cache-slots is {per_layer}; give 0 or more slots per MoE layer.")
    slots = {layer: min(per_layer, mb.n_experts) for layer in mb.moe_layers}
    for g, f in enumerate(free):
        need = sum(s for layer, s in slots.items() if layer_device.get(layer) == g) * mb.max_expert_bytes
        if need > f:
            raise PlacementError(
                f"--expert-cache-slots {per_layer} needs {size(need)} of expert cache on device {g} but "
                f"{size(max(f, 0))} is free after the weights, KV cache and workspace; give fewer slots or more "
                f"--gpu-memory-gib.")
    return slots


def make_plan(spec: Any, tensors: Mapping[str, TensorLike], devices: Devices,
              options: PlanOptions | None = None, metadata: Mapping[str, Any] | None = None,
              mode: str | None = None, cache_slots: int | None = None) -> PlacementPlan:
    """Place the model whose real tensor sizes are `tensors` (e.g. `bundle.tensors`) on `devices`.

    `mode` "all-device" or "heterogeneous" insists on that mode (None: all-device when it fits);
    `cache_slots` sets the hot-expert cache slots of every MoE layer (None: the free memory's worth).
    """
    opts = options or PlanOptions()
    mb = model_bytes(spec, tensors)
    meta = dict(metadata) if metadata is not None else spec_metadata(spec)
    kv = kv_reserve(spec.architecture, meta, opts.context_length, opts.batch, opts.kv_dtype,
                    spec.kv_values_per_token())
    rows = {t.role: t.rows for t in mb.tensors if t.layer is None}
    hidden = int(meta.get(f"{spec.architecture}.embedding_length") or 0)
    vocab = rows.get("head", rows.get(EMBEDDING, 0))
    n = len(devices.gpus)
    ctx_overhead = int(opts.cuda_context_gib * GIB) if n else 0
    ws = workspace(hidden, vocab, opts.batch, min(opts.prefill_chunk, opts.context_length), ctx_overhead)
    assumptions = [f"KV cache: {kv.rule} = {size(kv.total)}", f"workspace: {ws.rule}",
                   f"host: weights stay memory-mapped from the file; {opts.host_reserve_gib:g} GiB of host "
                   f"memory is kept for the OS and the process"]
    if n == 0:
        return _cpu_plan(spec, mb, kv, ws, devices, opts, assumptions)
    caps = [g.memory_bytes - ws.on_device(i == n - 1) for i, g in enumerate(devices.gpus)]
    assumptions.append("one process: split by layer in order over its GPUs (under torchrun each rank holds a "
                       "tensor-parallel share of every layer instead; this plan does not model that), "
                       "filled in proportion to each GPU's memory; embedding on the first GPU, head on the "
                       "last; each layer's KV cache sits with the layer")
    forced = mode
    split = None if forced == "heterogeneous" else split_pieces(_pieces(mb, kv, True), caps)
    mode = "all-device"
    if split is None and forced == "all-device":
        need = mb.total + kv.total
        raise PlacementError(
            f"--mode all-device needs every weight ({size(mb.total)}) plus the KV cache ({size(kv.total)}) on "
            f"device, {size(need)} in all, but {n} device(s) of {', '.join(size(g.memory_bytes) for g in devices.gpus)}"
            f" cannot hold it; use --mode heterogeneous (or auto), more --gpu-memory-gib, or a shorter context.")
    if split is None:
        mode = "heterogeneous"
        pieces = _pieces(mb, kv, False)
        split = split_pieces(pieces, caps)
        if split is None:
            raise _refuse_device(mb, kv, ws, devices, opts, pieces)
        need = mb.routed + int(opts.host_reserve_gib * GIB)
        if need > devices.host_memory_bytes:
            raise PlacementError(
                f"the routed experts ({size(mb.routed)}) plus the {opts.host_reserve_gib:g} GiB host reserve "
                f"need {size(need)} of host memory but {size(devices.host_memory_bytes)} is available; add "
                f"host memory or GPUs (more GPU memory keeps experts on device), or use a smaller quant.")
    layer_device = {p.layer: g for p, g in zip(_pieces(mb, kv, True), split, strict=True) if p.layer is not None}
    weights: list[dict[str, int]] = [{} for _ in range(n)]
    for t in mb.tensors:
        if mode == "all-device" or t.role != ROUTED:
            w = weights[_place(t, layer_device, n)]
            w[t.role] = w.get(t.role, 0) + t.nbytes
    kv_dev = [sum(b for layer, b in kv.per_layer.items() if layer_device.get(layer) == g) for g in range(n)]
    ws_dev = [ws.on_device(g == n - 1) for g in range(n)]
    free = [devices.gpus[g].memory_bytes - sum(weights[g].values()) - kv_dev[g] - ws_dev[g] for g in range(n)]
    slots = _slots(mb, layer_device, free) if mode == "heterogeneous" else {}
    if slots and cache_slots is not None:
        slots = _fixed_slots(mb, layer_device, free, cache_slots)
    dev_slots = [sum(s for layer, s in slots.items() if layer_device[layer] == g) for g in range(n)]
    assignments = tuple(
        DeviceAssignment(d.name, d.memory_bytes, tuple(sorted(k for k, v in layer_device.items() if v == g)),
                         weights[g], kv_dev[g], ws_dev[g], dev_slots[g], dev_slots[g] * mb.max_expert_bytes)
        for g, d in enumerate(devices.gpus))
    notes: list[str] = []
    if mode == "all-device":
        resident = {layer: frozenset(range(mb.n_experts)) for layer in mb.moe_layers}
        host: dict[str, int] = {}
        assumptions.append("all-device: every routed expert is resident; decode does no host-to-device copies")
    else:
        resident = {layer: frozenset() for layer in mb.moe_layers}
        host = {ROUTED: mb.routed}
        assumptions.append(
            f"heterogeneous: routed experts stay in (pinned) host memory; embedding, attention, norms, "
            f"router, shared experts, dense FFN and head are on device; free device memory becomes hot-expert "
            f"cache slots of {size(mb.max_expert_bytes)} (the largest gate+up+down of one expert), spread "
            f"evenly over each GPU's MoE layers, at most E per layer; no expert is pinned: the cache fills "
            f"at run time")
        short = [layer for layer, s in slots.items() if s < mb.n_experts_used]
        if short:
            notes.append(f"{len(short)} MoE layer(s) have fewer cache slots than top-k={mb.n_experts_used}; "
                         f"their misses cannot all be staged in one step and are computed on the CPU")
    est = decode_estimates(mode, mb, kv.total // opts.batch, slots, opts.bandwidths,
                           spec.attention_flops_per_token(opts.context_length), opts.compute,
                           device_is_cpu=all(g.name.startswith("cpu") for g in devices.gpus))
    return PlacementPlan(mode, assignments, devices.host_memory_bytes, host, layer_device, resident,
                         sum(slots.values()), slots, mb.max_expert_bytes, kv.total, sum(ws_dev), opts, est,
                         (*assumptions, *est.assumptions), tuple(notes))


def _cpu_plan(spec: Any, mb: ModelBytes, kv: KVReserve, ws: Workspace, devices: Devices, opts: PlanOptions,
              assumptions: list[str]) -> PlacementPlan:
    host = {**mb.by_role(), "kv_cache": kv.total, "workspace": ws.on_device(True)}
    reserve = int(opts.host_reserve_gib * GIB)
    need = sum(host.values()) + reserve
    if need > devices.host_memory_bytes:
        raise PlacementError(
            f"CPU-only placement needs {size(need)} of host memory (weights {size(mb.total)} + KV cache "
            f"{size(kv.total)} + workspace {size(host['workspace'])} + reserve {size(reserve)}) but "
            f"{size(devices.host_memory_bytes)} is available; add a GPU (--num-gpus), host memory, a shorter "
            f"--context-length, or use a smaller quant.")
    assumptions.append("cpu: no GPU; every tensor, the KV cache and the workspace are in host memory")
    est = decode_estimates("cpu", mb, kv.total // opts.batch, {}, opts.bandwidths,
                           spec.attention_flops_per_token(opts.context_length), opts.compute)
    return PlacementPlan("cpu", (), devices.host_memory_bytes, host, {}, {layer: frozenset() for layer in
                         mb.moe_layers}, 0, {}, mb.max_expert_bytes, kv.total, host["workspace"], opts, est,
                         (*assumptions, *est.assumptions))
