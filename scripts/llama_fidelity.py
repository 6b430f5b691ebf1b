"""Reproduce docs/fidelity.md: a deepseek2 file quantized by llama.cpp's quantizer, our native logits against
llama.cpp's (F32 KV cache, flash attention off), llama.cpp against itself at another batch split, and where
layer 0's rows part (with the activation-quantizer near-ties that explain each one).

    PYTHONPATH=. python scripts/llama_fidelity.py --out /tmp/fid [--preset bench --layers 4 --experts 16 --top-k 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_deepseek2_fidelity as fid  # noqa: E402
from llama_parity import llama_quantize, llama_tensors  # noqa: E402

from pocketmoe.testing.synth import write_fixture  # noqa: E402

NAMES = {"q-0", "kqv-0", "kqv_out-0", "ffn_inp-0", "ffn_norm-0", "ffn_swiglu-0", "l_out-0"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the F32 and Q4_K_M files")
    p.add_argument("--preset", default="bench")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    f32 = a.out / f"{a.preset}-{a.layers}.f32.gguf"
    if not f32.exists():
        write_fixture("deepseek2", a.preset, "F32", f32, n_layer=a.layers, n_expert=a.experts, n_expert_used=a.top_k)
    q = llama_quantize(f32, a.out / f"{a.preset}-{a.layers}.q4_k_m.gguf", "Q4_K_M")
    from pocketmoe.gguf import open_bundle

    cfg_vocab = open_bundle(q).tensors["token_embd.weight"].shape[0]
    fid.PROMPT = [int(t) for t in np.random.default_rng(9).integers(2, cfg_vocab, a.tokens)]
    t = len(fid.PROMPT)
    whole, theirs = llama_tensors(q, fid.PROMPT, NAMES)
    single, _ = llama_tensors(q, fid.PROMPT, set(), ubatch=1)
    eight, _ = llama_tensors(q, fid.PROMPT, set(), ubatch=8)
    mine, ours = fid.ours(q)
    f32_theirs, _ = llama_tensors(f32, fid.PROMPT, set())
    print(f"F32 file: max |dlogit| ours vs llama.cpp {np.abs(fid.ours(f32)[0] - f32_theirs).max():.3g}")
    print(f"logit std {whole.std():.3g}")
    print(f"mean |dlogit| ours vs llama.cpp (one ubatch): {np.abs(mine - whole).mean():.3g}  "
          f"(max {np.abs(mine - whole).max():.3g})")
    print(f"mean |dlogit| ours vs llama.cpp (ubatch 1):   {np.abs(mine - single).mean():.3g}")
    print(f"mean |dlogit| llama.cpp one ubatch vs ubatch 1: {np.abs(whole - single).mean():.3g}  "
          f"(max {np.abs(whole - single).max():.3g})")
    print(f"mean |dlogit| llama.cpp one ubatch vs ubatch 8: {np.abs(whole - eight).mean():.3g}  "
          f"(max {np.abs(whole - eight).max():.3g})")
    rows = {k: v.reshape(t, -1) if k != "kqv-0" else np.moveaxis(v.reshape(-1, t, v.shape[-1]), 1, 0).reshape(t, -1)
            for k, v in theirs.items()}
    for name in ("ffn_inp-0", "l_out-0"):
        rel = fid.row_rel(ours[name], rows[name])
        print(f"{name} per-row max relative difference: " + " ".join(f"{v:.0e}" for v in rel))
    heads = theirs["kqv-0"].shape[-3]
    q_nope = rows["q-0"].reshape(t, heads, -1)[..., :fid.N_NOPE].reshape(t, -1)
    for name, x, block in (("q_nope-0", q_nope, 32), ("kqv-0", rows["kqv-0"], 256),
                           ("kqv_out-0", rows["kqv_out-0"], 256), ("ffn_norm-0", rows["ffn_norm-0"], 256),
                           ("ffn_swiglu-0", rows["ffn_swiglu-0"], 256)):
        ulps = fid.tie_ulps(x, block)
        near = np.nonzero(ulps <= fid.TIE_ULPS)[0]
        print(f"rows of {name} with a value within {fid.TIE_ULPS} ulp of a Q8 rounding tie: "
              + ", ".join(f"{i} ({ulps[i]:.0f} ulp)" for i in near))
    return 0


if __name__ == "__main__":
    sys.exit(main())
