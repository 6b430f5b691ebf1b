"""Layers bound to raw GGUF tensor views: linear, norm, rope, MLA attention, MoE."""

from pocketmoe.layers.attention import MLAConfig, MLAttention
from pocketmoe.layers.experts import ExpertBank, ExpertWeights, ReferenceExperts
from pocketmoe.layers.linear import LinearBackend, QuantEmbedding, QuantLinear, ReferenceBackend
from pocketmoe.layers.mlp import GatedMLP
from pocketmoe.layers.moe import MoEBlock, Router, RouterConfig
from pocketmoe.layers.norm import RMSNorm
from pocketmoe.layers.rotary import RopeConfig, Rotary, apply_rope

__all__ = [
    "ExpertBank", "ExpertWeights", "GatedMLP", "LinearBackend", "MLAConfig", "MLAttention", "MoEBlock",
    "QuantEmbedding", "QuantLinear", "RMSNorm", "ReferenceBackend", "ReferenceExperts", "RopeConfig",
    "Rotary", "Router", "RouterConfig", "apply_rope",
]
