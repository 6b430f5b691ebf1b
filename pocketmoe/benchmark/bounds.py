"""The physical decode bound: weight bytes read per decode token, over measured host read bandwidth.

Per token a decoder reads k of E routed experts in each MoE layer (k/E of every routed-expert
tensor), every other weight once (attention, norms, routers, shared experts, dense FFNs, the head),
and one row of each per-token lookup table (token_embd; deepseek4's hash-routing table). With a
tied head (no output.weight) the whole token_embd is read as the head. KV cache reads are not
counted, so the bound is an upper bound on tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pocketmoe.specs import Role, spec_from_bundle

LOOKUP_SUFFIXES = ("ffn_gate_tid2eid.weight",)  # router tables indexed by token id, like token_embd


@dataclass(frozen=True)
class DecodeBytes:
    routed: int        # k experts per MoE layer
    dense: int         # every non-routed weight, read in full
    lookup: int        # one row per lookup table

    @property
    def total(self) -> int:
        return self.routed + self.dense + self.lookup


def _row_bytes(info: Any) -> int:
    return int(info.nbytes) // int(info.shape[0])


def decode_bytes_per_token(bundle: Any) -> DecodeBytes:
    """Weight bytes one decode token reads from `bundle` (an open GGUFBundle), by the model's spec."""
    spec = spec_from_bundle(bundle)
    infos = bundle.tensors
    present = [t for t in spec.tensors(infos.keys()) if t.name in infos]
    k, n_expert = spec.n_experts_used, spec.n_experts
    tied_head = not any(t.role == Role.HEAD for t in present)
    routed = dense = lookup = 0
    for t in present:
        info = infos[t.name]
        if t.role == Role.ROUTED_EXPERT:
            routed += int(info.nbytes) // n_expert * k
        elif t.role == Role.EMBEDDING and tied_head:
            dense += int(info.nbytes)
        elif t.role == Role.EMBEDDING or t.name.endswith(LOOKUP_SUFFIXES):
            lookup += _row_bytes(info)
        else:
            dense += int(info.nbytes)
    return DecodeBytes(routed, dense, lookup)


def decode_bound(b: DecodeBytes, read_gbps: float, bandwidth_method: str,
                 decode_tok_s: float | None = None) -> dict[str, Any]:
    """The JSON `bound` object: bandwidth, bytes per token, the tok/s bound and the measured fraction."""
    bound = read_gbps * 1e9 / b.total if b.total else None
    return {
        "read_bandwidth_gbps": round(read_gbps, 2),
        "bytes_per_token": b.total,
        "routed_bytes_per_token": b.routed,
        "decode_tok_s_bound": round(bound, 3) if bound else None,
        "decode_fraction_of_bound": round(decode_tok_s / bound, 4) if bound and decode_tok_s else None,
        "method": (f"weight bytes read per decode token (k of E routed experts per MoE layer, every other "
                   f"weight, one embedding row; KV cache excluded) over host read bandwidth "
                   f"({bandwidth_method})"),
    }
