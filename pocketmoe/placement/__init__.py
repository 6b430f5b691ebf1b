"""Placement: where weights, KV cache and hot-expert cache live, and how fast decode can be there."""

from pocketmoe.placement.estimate import (
    Bandwidths,
    ComputeRates,
    DecodeEstimates,
    Estimate,
    decode_estimates,
    hit_rate,
)
from pocketmoe.placement.inventory import ModelBytes, PlannedTensor, model_bytes, spec_tensor_infos
from pocketmoe.placement.plan import (
    DeviceAssignment,
    Devices,
    DeviceSpec,
    PlacementError,
    PlacementPlan,
    PlanOptions,
)
from pocketmoe.placement.planner import make_plan, spec_metadata
from pocketmoe.placement.report import plan_report
from pocketmoe.placement.reserve import KV_DTYPE_BYTES, KVReserve, Workspace, kv_reserve, workspace

__all__ = [
    "Bandwidths", "ComputeRates", "DecodeEstimates", "Estimate", "decode_estimates", "hit_rate",
    "ModelBytes", "PlannedTensor", "model_bytes", "spec_tensor_infos",
    "DeviceAssignment", "Devices", "DeviceSpec", "PlacementError", "PlacementPlan", "PlanOptions",
    "make_plan", "spec_metadata", "plan_report",
    "KV_DTYPE_BYTES", "KVReserve", "Workspace", "kv_reserve", "workspace",
]
