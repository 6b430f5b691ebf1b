"""What a run reports about its experts: placement, cache statistics and the predicted decode tok/s.

Two predictions sit beside the measured figure: the plan's bandwidth bound for the mode and policy
(placement.estimate, the figure inspect_gguf prints) and the cost model's, from the calibrated rates:
1 / (the model's routed-expert seconds per token of the steps seen + the non-expert bytes one token
reads, at the device's calibrated GB/s + attention at the plan's full context: its KV read at that rate or
its arithmetic at the plan's compute rate for the device, whichever is longer).
"""

from __future__ import annotations

from typing import Any

from pocketmoe.experts.cost import GB

# which of the plan's estimates a policy follows in heterogeneous mode
_HETERO_ESTIMATE = {"auto": "dispatch", "cache": "staged", "stage": "staged", "cpu": "cpu-experts"}


def plan_estimate(plan: Any, policy: str) -> float | None:
    name = {"cpu": "cpu", "all-device": "all-device"}.get(plan.mode) or _HETERO_ESTIMATE[policy]
    for e in plan.estimates.estimates:
        if e.name == name:
            return e.tok_s
    return None


def expert_report(runner: Any, stats: Any = None) -> dict[str, Any]:
    """JSON-able: mode, device(s), policy, rates, stats (`stats` or the runner's own) and predictions."""
    plan, rt = runner.plan, runner.experts
    policy = rt.policy if rt is not None else "cpu"
    out: dict[str, Any] = {"mode": plan.mode, "devices": [d.name for d in plan.devices], "expert_policy": policy,
                           "cache_slots": plan.cache_slots, "plan_decode_tok_s": plan_estimate(plan, policy)}
    numa = getattr(runner, "numa", None)
    if numa is not None:
        out["numa"] = numa.to_json()
    if rt is None:
        return out
    stats = stats if stats is not None else rt.stats
    js = stats.to_json()
    if plan.mode == "all-device":  # every expert resident (on the CPU device the host bank itself runs)
        js.update(hit_rate=1.0, bytes_copied_per_token=0.0, cpu_experts_per_token=0.0)
    out["stats"] = js
    out["rates_gbps"] = None if rt.rates is None else rt.rates.to_json()
    out["cost_model_decode_tok_s"] = None
    if rt.rates is not None and js["tokens"]:
        est = plan.estimates
        kv_gbps = rt.rates.device_gbps
        rest = est.non_expert_bytes_per_token / GB / kv_gbps + est.attention_seconds_per_token(kv_gbps)
        seconds = js["model_expert_seconds_per_token"] + rest
        out["cost_model_decode_tok_s"] = 1.0 / seconds if seconds > 0 else None
    return out
