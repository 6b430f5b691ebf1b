"""Text report of a PlacementPlan: devices, bytes by role, hot-expert cache, decode estimates, assumptions."""

from __future__ import annotations

from collections.abc import Iterable

from pocketmoe.cli_util import gib, size, sizes, table
from pocketmoe.placement.plan import PlacementPlan


def ranges(ids: Iterable[int]) -> str:
    """`0-13,15`: sorted ids folded into runs."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


def _header(plan: PlacementPlan) -> str:
    o = plan.options
    gpus = ", ".join(f"{d.name} {gib(d.memory_bytes)}" for d in plan.devices) or "none"
    return (f"Placement: {plan.mode}; GPUs: {gpus}; host memory {gib(plan.host_memory_bytes)}; context "
            f"{o.context_length} x batch {o.batch}, KV {o.kv_dtype}")


def _columns(*cols: list[object]) -> list[list[object]]:
    return [list(r) for r in zip(*cols, strict=True)]


def _devices(plan: PlacementPlan) -> str:
    ds = plan.devices
    rows = _columns([d.name for d in ds], sizes([d.memory_bytes for d in ds]), [ranges(d.layers) for d in ds],
                    sizes([sum(d.weights.values()) for d in ds]), sizes([d.kv_bytes for d in ds]),
                    sizes([d.workspace_bytes for d in ds]), sizes([d.cache_bytes for d in ds]),
                    [d.cache_slots for d in ds], sizes([d.free for d in ds]))
    head = ["device", "memory", "layers", "weights", "KV cache", "workspace", "expert cache", "slots", "free"]
    return "Devices\n" + table(head, rows)


def _roles(plan: PlacementPlan) -> str:
    per_dev = plan.per_device_bytes
    places = [*per_dev.values(), dict(plan.host_bytes)]
    roles: list[str] = []
    for d in places:
        roles += [r for r in d if r not in roles and any(p.get(r, 0) for p in places)]
    cols: list[list[object]] = [[*roles, "total"]]
    for p in places:
        vals = [p.get(r, 0) for r in roles] + [sum(p.values())]
        cols.append([t if v else "-" for t, v in zip(sizes(vals), vals, strict=True)])
    return "Bytes by role\n" + table(["role", *per_dev, "host"], _columns(*cols))


def _cache(plan: PlacementPlan) -> str:
    if plan.mode == "all-device":
        n = max((len(v) for v in plan.resident.values()), default=0)
        return f"Routed experts: all {n} experts of {len(plan.resident)} MoE layers resident on device"
    if plan.mode == "cpu":
        return "Routed experts: in host memory, computed on the CPU"
    per = list(plan.slots_per_layer.values())
    spread = f"{min(per)}-{max(per)}" if per and min(per) != max(per) else (str(per[0]) if per else "0")
    return (f"Hot-expert cache: {plan.cache_slots} slots of {size(plan.expert_slot_bytes)} "
            f"({size(plan.cache_slots * plan.expert_slot_bytes)}); {spread} slots per MoE layer of "
            f"{len(per)} layers")


def _estimates(plan: PlacementPlan) -> str:
    e = plan.estimates
    rows = [[x.name, f"{x.tok_s:.2f}", f"{x.seconds_per_token * 1e3:.1f}", x.formula] for x in e.estimates]
    math = "" if not e.attention_flops_per_token else f", attention {e.attention_flops_per_token / 1e9:.3f} GFLOP"
    lines = [f"Decode estimates (single sequence at {plan.options.context_length} tokens)",
             table(["estimate", "tok/s", "ms/token", "time per token"], rows),
             f"  B_tok {e.routed_bytes_per_token / 1e9:.3f} GB, non-expert {e.non_expert_bytes_per_token / 1e9:.3f}"
             f" GB, KV {e.kv_bytes_per_token / 1e9:.3f} GB{math} per token; best: {e.best.name}"]
    if plan.mode == "heterogeneous":
        verdict = "stage misses" if e.hit_rate > e.stage_threshold else "compute misses on the CPU"
        lines.append(f"  hit rate h = {e.hit_rate:.3f}; staging beats CPU compute only when h > "
                     f"1 - BW_PCIe/BW_DRAM = {e.stage_threshold:.3f}: {verdict}")
    return "\n".join(lines)


def plan_report(plan: PlacementPlan) -> str:
    parts = [_header(plan)]
    if plan.devices:
        parts.append(_devices(plan))
    parts += [_roles(plan), _cache(plan), _estimates(plan),
              "Assumptions\n" + "\n".join(f"  - {a}" for a in plan.assumptions)]
    if plan.notes:
        parts.append("Notes\n" + "\n".join(f"  - {n}" for n in plan.notes))
    return "\n\n".join(parts)
