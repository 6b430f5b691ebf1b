"""The built-in demo model: a small DeepSeek-V2-shaped MoE shipped inside the package.

`demo_model_path()` is the file `python -m pocketmoe.generate` uses without `--model`. It was trained
by `scripts/train_demo_model.py` on the docstrings of Python's standard library (see
docs/demo-model.md), so it writes recognisable English about Python and answers questions such as
"What does the json module do?" in a sentence; its experts are used unevenly, as in real MoE models.

`expert_routing()` recomputes which routed experts each token picks, with a small float torch
forward over the file's dequantized weights. It is independent of the engine, for statistics
(the expert-usage plots in the docs, the tests' skew check).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
DEMO_MODEL_FILE = "demo-model.gguf"
HELDOUT_FILE = "demo-model-heldout.json"     # held-out text the model never trained on
TRAIN_LOG_FILE = "demo-model-train.json"     # the training run's loss curve and settings


def demo_model_path() -> Path:
    """The shipped demo model's GGUF file (PocketMoEError if this install lacks it)."""
    path = DATA_DIR / DEMO_MODEL_FILE
    if not path.is_file():
        raise PocketMoEError(
            f"the built-in demo model {path} is missing from this install; reinstall PocketMoE "
            "(`pip install -e .` from a checkout), rebuild it with `python scripts/train_demo_model.py`, "
            "or pass --model PATH to a GGUF file.")
    return path


def heldout_texts() -> list[str]:
    """Documents and chat exchanges from the held-out part of the training corpus (plain text)."""
    path = DATA_DIR / HELDOUT_FILE
    if not path.is_file():
        raise PocketMoEError(f"the demo model's held-out sample {path} is missing from this install.")
    return list(json.loads(path.read_text(encoding="utf-8")))


class _Weights:
    """Dequantized float32 tensors of a deepseek2 file, loaded on first use."""

    def __init__(self, path: str | Path) -> None:
        from pocketmoe.gguf import open_bundle
        from pocketmoe.specs import spec_from_bundle

        self.bundle = open_bundle(path)
        self.spec = spec_from_bundle(self.bundle)
        c = self.spec.config
        if self.bundle.architecture != "deepseek2" or getattr(c, "q_lora_rank", 1) or c.mla_layout != "absorbed" \
                or c.gating_func != 1 or c.rope_scaling.kind != "none" or c.n_expert_groups != 1:
            raise PocketMoEError(
                f"expert_routing() covers deepseek2 files with absorbed MLA, no q LoRA, softmax gating, "
                f"no expert groups and no rope scaling (as the demo model); {path} is not one.")
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        from pocketmoe.quant import dequantize

        if name not in self._cache:
            info = self.bundle.tensors[name]
            self._cache[name] = dequantize(self.bundle.raw_torch(name), info.ggml_type, info.shape)
        return self._cache[name]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def expert_routing(path: str | Path, token_ids: Sequence[int] | Sequence[Sequence[int]]
                   ) -> dict[int, torch.Tensor]:
    """{MoE layer: int64 [T, k] routed expert ids per token} for one or several token sequences
    (each run from position 0; the rows of several sequences are concatenated in order)."""
    import torch

    w = _Weights(path)
    c = w.spec.config
    seqs = [list(token_ids)] if token_ids and isinstance(token_ids[0], int) else [list(s) for s in token_ids]
    out: dict[int, list[torch.Tensor]] = {i: [] for i in range(c.n_dense_lead, c.n_layer)}
    nope, rope_d, kv_lora, n_head = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.n_head
    inv = c.rope_freq_base ** (-torch.arange(0, rope_d, 2, dtype=torch.float64) / rope_d)
    with torch.no_grad():
        for seq in seqs:
            t = len(seq)
            ang = torch.arange(t, dtype=torch.float64)[:, None] * inv
            cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]

            def rope(z: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
                a, b = z.unflatten(-1, (-1, 2)).unbind(-1)
                return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

            x = w("token_embd.weight")[torch.tensor(seq)]
            mask = torch.full((t, t), float("-inf")).triu(1)
            for i in range(c.n_layer):
                p = f"blk.{i}."
                h = _rms(x, w(p + "attn_norm.weight"), c.rms_eps)
                q = (h @ w(p + "attn_q.weight").t()).view(t, n_head, nope + rope_d)
                q_nope, q_pe = q.split([nope, rope_d], dim=-1)
                ckv, k_pe = (h @ w(p + "attn_kv_a_mqa.weight").t()).split([kv_lora, rope_d], dim=-1)
                ckv = _rms(ckv, w(p + "attn_kv_a_norm.weight"), c.rms_eps)
                qa = torch.einsum("thn,hln->thl", q_nope, w(p + "attn_k_b.weight"))
                s = torch.einsum("thl,sl->hts", qa, ckv) + torch.einsum("thr,sr->hts", rope(q_pe),
                                                                        rope(k_pe[:, None, :])[:, 0])
                attn = (s * c.attn_scale + mask).softmax(-1)
                o = torch.einsum("hts,sl,hvl->thv", attn, ckv, w(p + "attn_v_b.weight"))
                x = x + o.reshape(t, -1) @ w(p + "attn_output.weight").t()
                h = _rms(x, w(p + "ffn_norm.weight"), c.rms_eps)
                if i < c.n_dense_lead:
                    g, u, d = (w(p + f"ffn_{k}.weight") for k in ("gate", "up", "down"))
                    x = x + (torch.nn.functional.silu(h @ g.t()) * (h @ u.t())) @ d.t()
                    continue
                probs = (h @ w(p + "ffn_gate_inp.weight").t()).softmax(-1)
                weights, ids = probs.topk(c.n_expert_used, dim=-1)
                out[i].append(ids)
                y = torch.zeros_like(x)
                gate, up, down = (w(p + f"ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
                for slot in range(c.n_expert_used):
                    for e in ids[:, slot].unique().tolist():
                        rows = (ids[:, slot] == e).nonzero()[:, 0]
                        he = h[rows]
                        ye = (torch.nn.functional.silu(he @ gate[e].t()) * (he @ up[e].t())) @ down[e].t()
                        y[rows] += ye * weights[rows, slot, None] * c.expert_weights_scale
                if c.n_expert_shared:
                    g, u, d = (w(p + f"ffn_{k}_shexp.weight") for k in ("gate", "up", "down"))
                    y = y + (torch.nn.functional.silu(h @ g.t()) * (h @ u.t())) @ d.t()
                x = x + y
    return {i: torch.cat(v) for i, v in out.items()}


def usage_share_of_top(ids: torch.Tensor, n_expert: int, fraction: float = 0.25) -> float:
    """Share of all expert assignments in `ids` that go to the most used `fraction` of the experts."""
    import torch

    counts = torch.bincount(ids.reshape(-1), minlength=n_expert).sort(descending=True).values
    top = max(1, math.ceil(n_expert * fraction))
    return float(counts[:top].sum() / counts.sum())
