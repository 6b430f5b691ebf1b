"""Host banks: routed experts in host memory, computed on the CPU (the CPU plan's banks, as before).

They live in layers/experts.py beside the ExpertBank protocol (the native backend's fused MoE sublayer
recognises NativeExperts); this module names them for the placement side.
"""

from pocketmoe.layers.experts import NativeExperts as HostExperts
from pocketmoe.layers.experts import ReferenceExperts, host_experts_factory

__all__ = ["HostExperts", "ReferenceExperts", "host_experts_factory"]
