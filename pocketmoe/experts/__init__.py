"""ExpertBanks the placement plan picks: host (CPU compute), resident (all-device), and the heterogeneous
dispatch over a hot-expert slot cache with staging and a cost model."""

from pocketmoe.experts.build import ExpertRuntime, plan_device, plan_experts_factory
from pocketmoe.experts.cache import ADMISSIONS, EVICTIONS, SlotCache
from pocketmoe.experts.cost import CPU, HIT, POLICIES, STAGE, Active, Decision, Rates, decide
from pocketmoe.experts.dispatch import DispatchExperts
from pocketmoe.experts.host import HostExperts
from pocketmoe.experts.kernels import ExpertStore, NativeKernels, ReferenceKernels
from pocketmoe.experts.resident import ResidentExperts
from pocketmoe.experts.staging import CopyEngine, SlotInUseError, SlotPool
from pocketmoe.experts.stats import ExpertStats

__all__ = [
    "ExpertRuntime", "plan_device", "plan_experts_factory", "ADMISSIONS", "EVICTIONS", "SlotCache",
    "CPU", "HIT", "POLICIES", "STAGE", "Active", "Decision", "Rates", "decide", "DispatchExperts",
    "HostExperts", "ExpertStore", "NativeKernels", "ReferenceKernels", "ResidentExperts", "CopyEngine",
    "SlotInUseError", "SlotPool", "ExpertStats",
]
