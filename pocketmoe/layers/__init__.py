"""Architecture-agnostic blocks bound to raw GGUF tensor views, computed by the ops they are built with:
linear, norm, rope, MLA attention, MoE (router, expert banks)."""

from pocketmoe.layers.attention import MLAConfig, MLAttention
from pocketmoe.layers.experts import (
    ExpertBank,
    ExpertsFactory,
    ExpertWeights,
    NativeExperts,
    ReferenceExperts,
)
from pocketmoe.layers.linear import LinearBackend, QuantEmbedding, QuantLinear, ReferenceBackend
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock, Router, RouterConfig
from pocketmoe.layers.norm import Residual, RMSNorm
from pocketmoe.layers.rotary import RopeConfig, Rotary, apply_rope

__all__ = [
    "ExpertBank", "ExpertWeights", "ExpertsFactory", "NativeExperts", "GatedMLP", "LinearBackend", "MLAConfig", "MLAttention", "MoEBlock",
    "QuantEmbedding", "QuantLinear", "RMSNorm", "Residual", "ReferenceBackend", "ReferenceExperts", "RopeConfig",
    "Rotary", "Router", "RouterConfig", "apply_rope",
]
