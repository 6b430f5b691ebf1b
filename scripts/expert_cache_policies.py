"""Hit rates of the hot-expert cache's eviction / admission policies on real routing.

    PYTHONPATH=. python scripts/expert_cache_policies.py [--model pocketmoe/data/demo-model.gguf] [--slots 2,4,8]

Runs the real heterogeneous dispatcher (CPU device, policy "cache": every miss staged into the layer's
slots) over the held-out texts of the trained demo model: the first half of each text is the prompt
(one prefill chunk), the rest is fed back token by token as decode steps (teacher forcing, so every
policy sees the same routing). Prints the decode-step hit rate per policy and slot count, beside the
uniform-routing expectation slots / E.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.experts import ADMISSIONS, EVICTIONS, DispatchExperts, SlotCache
from pocketmoe.gguf import open_bundle
from pocketmoe.layers.moe import MoEBlock
from pocketmoe.placement.run import RunPlacement
from pocketmoe.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def banks(runner: ModelRunner) -> list[DispatchExperts]:
    out, seen, todo = [], set(), [runner.model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, MoEBlock):
            out.append(obj.experts)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("pocketmoe"):
            todo.extend(vars(obj).values())
    return [b for b in out if isinstance(b, DispatchExperts)]


def decode_hit_rate(bundle, texts: list[list[int]], slots: int, eviction: str, admission: str) -> float:
    rp = RunPlacement(device="cpu", mode="heterogeneous", expert_policy="cache", expert_cache_slots=slots)
    r = ModelRunner(bundle, RunnerConfig(n_ctx=1024, chunk_size=1024, backend="auto", threads=1, placement=rp))
    for b in banks(r):
        b.cache = SlotCache(slots, eviction, admission)
    st = r.experts.stats
    hits = lookups = 0
    for ids in texts:
        half = len(ids) // 2
        r.forward(ids[:half], 0, last_only=True)
        h0, m0 = st.hits, st.misses
        for pos in range(half, len(ids)):
            r.decode(ids[pos], pos)
        hits += st.hits - h0
        lookups += st.hits - h0 + st.misses - m0
    return hits / max(lookups, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "pocketmoe/data/demo-model.gguf"))
    p.add_argument("--texts", default=str(ROOT / "pocketmoe/data/demo-model-heldout.json"))
    p.add_argument("--slots", default="2,4,8")
    p.add_argument("--limit", type=int, default=24, help="held-out texts used")
    args = p.parse_args()
    with open_bundle(args.model) as bundle:
        tok = Tokenizer.from_metadata(bundle.metadata)
        texts = [tok.encode(t)[:256] for t in json.loads(Path(args.texts).read_text())[: args.limit]]
        texts = [t for t in texts if len(t) >= 8]
        n_exp = int(bundle.metadata[f"{bundle.architecture}.expert_count"])
        top_k = int(bundle.metadata[f"{bundle.architecture}.expert_used_count"])
        steps = sum(len(t) - len(t) // 2 for t in texts)
        print(f"{bundle.architecture}, E={n_exp}, top-{top_k}; {len(texts)} texts, {steps} decode steps")
        policies = [(e, a) for e in EVICTIONS for a in ADMISSIONS]
        print("slots  uniform  " + "  ".join(f"{e}/{a:>6}" for e, a in policies))
        for slots in (int(s) for s in args.slots.split(",")):
            rates = [decode_hit_rate(bundle, texts, slots, e, a) for e, a in policies]
            print(f"{slots:5d}  {slots / n_exp:7.3f}  " + "  ".join(f"{h:>10.3f}" for h in rates))


if __name__ == "__main__":
    main()
