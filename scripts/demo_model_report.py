"""The numbers and plots of docs/demo-model.md, from the shipped demo model and its training log.

    .venv/bin/pip install -e .[plots]        # matplotlib
    .venv/bin/python scripts/demo_model_report.py [--model pocketmoe/data/demo-model.gguf] [--out docs/demo-model]

Writes loss.png (training and held-out loss), expert-usage.png (each MoE layer's expert-usage
histogram on the held-out text) and lru-hit-rate.png (a hot-expert cache's hit rate, simulated as
an LRU per layer over the recorded routing), and prints the tables and sample outputs the doc shows.
Routing comes from `pocketmoe.demo_model.expert_routing` (a float torch forward over the file's
dequantized weights), perplexity from the engine (`LLM.prompt_logits`) on the same held-out text.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocketmoe import LLM, SamplingParams  # noqa: E402
from pocketmoe.demo_model import DATA_DIR, TRAIN_LOG_FILE, demo_model_path, expert_routing  # noqa: E402
from pocketmoe.specs import spec_from_bundle  # noqa: E402

CACHE_SLOTS = (2, 3, 4, 6, 8, 12)
PROMPTS = ("The argparse module", "The json module", "Return a list of", "The \"if\" statement")
QUESTIONS = ("What does os.path.join() do?", "What does the json module do?", "What does str.strip() do?",
             "What is a generator?")


def _train_module():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["train_demo_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def heldout_windows(llm: LLM, n_ctx: int) -> list[list[int]]:
    """Every held-out document and exchange of the training split, tokenized, cut into n_ctx windows."""
    t = _train_module()
    texts = []
    for d in t.collect_docs():
        if t.is_heldout(d):
            texts.append(t.doc_text(d))
            if qa := t.qa_pair(d):
                texts.append(t.chat_text(*qa))
    windows = []
    for text in texts:
        ids = llm.tokenizer.encode(text)
        windows += [ids[i:i + n_ctx] for i in range(0, len(ids), n_ctx) if len(ids[i:i + n_ctx]) > 1]
    return windows


def lru_hit_rate(ids: torch.Tensor, slots: int) -> float:
    """Per-layer LRU cache of `slots` experts, fed the [T, k] routed experts token by token."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in ids.tolist():
        for e in row:
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits / ids.numel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--log", type=Path, default=DATA_DIR / TRAIN_LOG_FILE)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "demo-model")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch.set_num_threads(2)
    path = args.model or demo_model_path()
    log = json.loads(args.log.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    n_ctx = int(log["config"]["seq_len"])
    llm = LLM(path, n_ctx=2 * n_ctx, threads=2)
    cfg = spec_from_bundle(llm.bundle).config
    E, K = cfg.n_expert, cfg.n_expert_used

    # -- loss curve ------------------------------------------------------------------------------
    curve = log["curve"]
    tokens = [r["tokens"] / 1e6 for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, [r["train_loss"] for r in curve], label="training (mean of the last steps)")
    ax.plot(tokens, [r["heldout_loss"] for r in curve], label="held-out modules")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(bottom=max(0.0, min(r["train_loss"] for r in curve) - 0.3), top=min(8.5, curve[0]["train_loss"] + 0.3))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Demo model training: {log['corpus']['train_tokens'] / 1e6:.2f}M-token corpus, "
                 f"{log['train_seconds'] / 60:.0f} min on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(args.out / "loss.png", dpi=110)
    plt.close(fig)

    # -- held-out perplexity of the shipped (quantized) file through the engine --------------------
    windows = heldout_windows(llm, n_ctx)
    nll, n = 0.0, 0
    for ids in windows:
        logits = llm.prompt_logits(ids)
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n += len(ids) - 1
    print(f"held-out: {len(windows)} windows, {n} predicted tokens; GGUF (engine) loss {nll / n:.3f}, "
          f"perplexity {math.exp(nll / n):.2f}; float model at the end of training: loss "
          f"{log['heldout_loss_final']:.3f}, perplexity {log['heldout_ppl_final']:.2f}")

    # -- expert usage ----------------------------------------------------------------------------
    routing = expert_routing(path, windows)
    layers = sorted(routing)
    counts = {i: torch.bincount(routing[i].reshape(-1), minlength=E).double() for i in layers}
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.4), sharey=True)
    for ax, i in zip(axes, layers, strict=True):
        share = counts[i] / counts[i].sum() * 100
        order = share.argsort(descending=True)
        ax.bar(range(E), share[order].numpy(), color="tab:blue")
        ax.axhline(100 / E, color="tab:red", ls="--", lw=1, label="uniform")
        ax.set_xticks(range(E))
        ax.set_xticklabels([str(int(e)) for e in order], fontsize=6, rotation=90)
        top = share[order][: E // 4].sum().item()
        ax.set_title(f"layer {i}: top {E // 4} take {top:.0f}%", fontsize=9)
        ax.set_xlabel("expert id (most used first)", fontsize=8)
    axes[0].set_ylabel("share of routed assignments (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Expert usage on held-out text ({routing[layers[0]].shape[0]} tokens, top-{K} of {E})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / "expert-usage.png", dpi=110)
    plt.close(fig)

    print("\n| layer | top quarter's share | most used expert | least used expert | "
          "max / mean | normalized entropy |")
    print("|---|---|---|---|---|---|")
    for i in layers:
        c = counts[i]
        s = (c / c.sum()).sort(descending=True).values
        ent = -(s[s > 0] * s[s > 0].log()).sum().item() / math.log(E)
        print(f"| {i} | {s[: E // 4].sum().item() * 100:.1f}% | {s[0].item() * 100:.1f}% | "
              f"{s[-1].item() * 100:.2f}% | {s[0].item() * E:.2f} | {ent:.3f} |")

    # -- hot-expert cache hit rate (LRU simulation per layer) ---------------------------------------
    rates = {s: [lru_hit_rate(routing[i], s) for i in layers] for s in CACHE_SLOTS if s >= K}
    static = {s: [(counts[i].sort(descending=True).values[:s].sum() / counts[i].sum()).item() for i in layers]
              for s in rates}
    shuffled = {s: [lru_hit_rate(routing[i][torch.randperm(len(routing[i]),
                                                           generator=torch.Generator().manual_seed(0))], s)
                    for i in layers] for s in rates}
    print("\n| cache slots per layer | share of experts | LRU hit rate (mean of layers) | per layer | "
          "LRU, tokens shuffled | pinned most-used set | uniform routing |")
    print("|---|---|---|---|---|---|---|")
    for s in rates:
        print(f"| {s} | {s / E:.0%} | {sum(rates[s]) / len(layers):.1%} | "
              f"{' / '.join(f'{r:.0%}' for r in rates[s])} | {sum(shuffled[s]) / len(layers):.1%} | "
              f"{sum(static[s]) / len(layers):.1%} | {s / E:.1%} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(rates)
    ax.plot(xs, [sum(rates[s]) / len(layers) * 100 for s in xs], "o-", label="LRU on the routing, in order")
    ax.plot(xs, [sum(shuffled[s]) / len(layers) * 100 for s in xs], "s--", label="LRU, tokens shuffled")
    ax.plot(xs, [sum(static[s]) / len(layers) * 100 for s in xs], "^-", label="pinned most-used experts")
    ax.plot(xs, [s / E * 100 for s in xs], ":", color="gray", label="uniform routing")
    ax.set_xlabel(f"cache slots per MoE layer (of {E} experts)")
    ax.set_ylabel("hit rate (% of expert lookups)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Hot-expert cache on held-out text (simulation)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / "lru-hit-rate.png", dpi=110)
    plt.close(fig)

    # -- sample outputs ----------------------------------------------------------------------------
    params = SamplingParams(temperature=0, max_tokens=48)
    print()
    for prompt in PROMPTS:
        print(f"prompt {prompt!r} -> {llm.generate(prompt, params)[0].text!r}")
    for q in QUESTIONS:
        print(f"chat {q!r} -> {llm.chat([{'role': 'user', 'content': q}], params).text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
