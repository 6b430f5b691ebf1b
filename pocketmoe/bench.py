"""Benchmark prefill and decode speed against llama.cpp and the host's memory-bandwidth bound.

    python -m pocketmoe.bench --model PATH [--prompt-tokens 128] [--gen-tokens 128] [--threads N]
        [--llama-cpp] [--json] [--profile] [--repeats N] [--backend auto|native|reference] [--n-ctx C]
        [--device ...] [--mode ...] [--gpu-memory-gib G[,G...]] [--expert-policy ...] [--expert-cache-slots N]
        [--numa auto|interleave|off]

llama.cpp's interpreter: $POCKETMOE_LLAMA_PYTHON (a venv with llama-cpp-python built for this CPU, plus numpy and
gguf; it needs no torch); without its repacked weight buffers: POCKETMOE_LLAMA_EXTRA_BUFTS=0.

Both engines get the same fixed pseudo-random prompt of ordinary token ids (no BOS). Prefill is one
pass over the prompt from position 0; decode is --gen-tokens greedy single-token steps. A warm-up
run comes first; with --repeats the median is reported. llama.cpp runs in a child process, so each
engine's peak memory is its own. The bound is bandwidth / weight bytes read per decode token.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pocketmoe.benchmark.timing import BenchSettings
from pocketmoe.cli_util import add_placement_args, placement_from_args, run_cli, size, table
from pocketmoe.defaults import DEFAULT_CHUNK_SIZE
from pocketmoe.errors import PocketMoEError

CTX_ROUND = 256


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", required=True, help="GGUF file, any shard of a bundle, or its directory")
    p.add_argument("--prompt-tokens", "-p", "--n-prompt", type=int, default=128,
                   help="prompt tokens (llama-bench's -p)")
    p.add_argument("--gen-tokens", "-n", "--n-gen", type=int, default=128,
                   help="greedy decode steps to time (llama-bench's -n)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads for both engines (default: all cores)")
    p.add_argument("--repeats", "-r", "--repetitions", type=int, default=1,
                   help="timed runs after the warm-up; the median is reported (llama-bench's -r)")
    p.add_argument("--n-ctx", type=int, default=None, help="context length (default: prompt + gen, rounded up)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"our prefill tokens per forward pass, llama.cpp's n_ubatch (default {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "reference"])
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size for the read-bandwidth probe")
    p.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (llama-cpp-python)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--profile", action="store_true",
                   help="time every op call and print where each token's time goes, by op (adds ~1 us a call)")
    p.add_argument("--engine", default="pocketmoe", choices=["pocketmoe", "llama-cpp"], help=argparse.SUPPRESS)
    p.add_argument("--token-ids", default=None, help=argparse.SUPPRESS)
    add_placement_args(p)
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    if args.token_ids is not None:
        try:
            args.prompt_tokens = len([int(t) for t in args.token_ids.split(",") if t])
        except ValueError:
            raise PocketMoEError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}.") from None
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--gen-tokens", args.gen_tokens),
                        ("--repeats", args.repeats), ("--chunk-size", args.chunk_size),
                        ("--bandwidth-mib", args.bandwidth_mib)):
        if value < 1:
            raise PocketMoEError(f"{flag} must be at least 1, got {value}.")
    if args.threads is None:
        from pocketmoe.hostinfo import physical_cores

        args.threads = physical_cores()
    if args.threads < 1:
        raise PocketMoEError(f"--threads must be at least 1, got {args.threads}.")
    need = args.prompt_tokens + args.gen_tokens
    n_ctx = args.n_ctx if args.n_ctx is not None else -(-need // CTX_ROUND) * CTX_ROUND
    if n_ctx < need:
        raise PocketMoEError(f"--n-ctx {n_ctx} cannot hold {args.prompt_tokens} prompt + {args.gen_tokens} "
                             f"generated tokens; give at least {need} or omit it.")
    return BenchSettings(args.prompt_tokens, args.gen_tokens, args.threads, args.repeats, n_ctx, args.chunk_size,
                         args.kv_dtype)


def llama_child(args: argparse.Namespace, s: BenchSettings) -> int:
    """The --engine llama-cpp child: time llama.cpp on the given ids, print one JSON object."""
    from pocketmoe.benchmark.llama_ref import require_llama_cpp, run_llama_cpp

    if args.token_ids is None:
        raise PocketMoEError("--engine llama-cpp needs --token-ids (the parent's prompt).")
    require_llama_cpp()
    ids = [int(t) for t in args.token_ids.split(",") if t]
    result, tokens = run_llama_cpp(args.model, ids, s)
    print(json.dumps({"llama_cpp": result, "tokens": tokens}))
    return 0


def run(model: Path, s: BenchSettings, backend: str, llama: bool, bandwidth_mib: int = 512,
        profile: bool = False, placement: Any = None) -> dict[str, Any]:
    from pocketmoe.benchmark.bounds import decode_bound, decode_bytes_per_token
    from pocketmoe.benchmark.llama_ref import require_llama_cpp, run_llama_cpp_subprocess
    from pocketmoe.benchmark.ours import run_pocketmoe
    from pocketmoe.benchmark.timing import matching_prefix
    from pocketmoe.hostinfo import measure_read_bandwidth

    if llama:
        require_llama_cpp()
    ours, ids, our_tokens, llm = run_pocketmoe(model, s, backend, profile, placement)
    llm.runner.stop_workers()  # tensor parallel: the other ranks are done
    arch = llm.bundle.architecture
    file_bytes = sum(p.stat().st_size for p in llm.bundle.paths)
    per_token = decode_bytes_per_token(llm.bundle)
    llm.close()
    del llm
    gc.collect()
    theirs, agree = None, None
    if llama:
        theirs, their_tokens = run_llama_cpp_subprocess(model, ids, s)
        agree = {"matching_prefix_tokens": matching_prefix(our_tokens, their_tokens),
                 "compared_tokens": min(len(our_tokens), len(their_tokens))}
    bw = measure_read_bandwidth(s.threads, size_mib=bandwidth_mib)
    ratio = None if theirs is None else {
        k: round(ours[f"{k}_tok_s"] / theirs[f"{k}_tok_s"], 4) if theirs[f"{k}_tok_s"] else None
        for k in ("prefill", "decode")}
    return {
        "model": str(model), "architecture": arch, "file_bytes": file_bytes, "threads": s.threads,
        "prompt_tokens": s.prompt_tokens, "gen_tokens": s.gen_tokens, "repeats": s.repeats, "n_ctx": s.n_ctx,
        "kv_dtype": s.kv_dtype,
        "pocketmoe": ours, "llama_cpp": theirs, "ratio": ratio, "greedy_agreement": agree,
        "bound": decode_bound(per_token, bw.gbps, f"{bw.method}, threads {bw.threads}", ours["decode_tok_s"]),
    }


def render(r: dict[str, Any], profile: bool = False) -> str:
    engines = [("pocketmoe", r["pocketmoe"])] + ([("llama.cpp", r["llama_cpp"])] if r["llama_cpp"] else [])
    bound = r["bound"]
    rows = [[name, e["backend"], f"{e['prefill_tok_s']:.2f}", f"{e['decode_tok_s']:.2f}",
             f"{e['peak_rss_mib']:.1f} MiB", f"{e['peak_anon_mib']:.1f} MiB", f"{e['load_s']:.2f}"]
            for name, e in engines]
    if r["ratio"]:
        rows.append(["ours / llama.cpp", "", f"{r['ratio']['prefill']:.3f} x", f"{r['ratio']['decode']:.3f} x",
                     "", "", ""])
    lines = [f"{r['architecture']} from {r['model']} ({size(r['file_bytes'])}), threads {r['threads']}, "
             f"prompt {r['prompt_tokens']} tokens, {r['gen_tokens']} generated, median of {r['repeats']}",
             "", table(["engine", "backend", "prefill tok/s", "decode tok/s", "peak RSS", "peak anon", "load s"],
                       rows), ""]
    if r["pocketmoe"].get("detail"):
        lines.append(f"pocketmoe: {r['pocketmoe']['detail']}")
    if r["pocketmoe"].get("experts"):
        lines.append(experts_line(r["pocketmoe"]["experts"]))
    if r["greedy_agreement"]:
        g = r["greedy_agreement"]
        lines.append(f"greedy tokens: {g['matching_prefix_tokens']} of {g['compared_tokens']} agree before "
                     "the first difference")
    lines.append(f"bound: {bound['read_bandwidth_gbps']:.1f} GB/s read / {bound['bytes_per_token'] / 1e9:.4f} "
                 f"GB per token = {bound['decode_tok_s_bound']:.1f} tok/s decode; ours reaches "
                 f"{100 * (bound['decode_fraction_of_bound'] or 0):.1f}% of it")
    if r["llama_cpp"] and bound["decode_tok_s_bound"]:
        frac = r["llama_cpp"]["decode_tok_s"] / bound["decode_tok_s_bound"]
        lines.append(f"       llama.cpp reaches {100 * frac:.1f}%")
    lines.append(f"       ({bound['method']})")
    if profile and r["pocketmoe"].get("profile"):
        lines += ["", render_profile(r["pocketmoe"]["profile"])]
    return "\n".join(lines)


def experts_line(x: dict[str, Any]) -> str:
    """Placement, the decode cache statistics and the predicted decode tok/s beside the measured one."""
    line = f"placement: {x['mode']}" + (f" on {', '.join(x['devices'])}, policy {x['expert_policy']}" if x["devices"] else "")
    st = x.get("stats")
    if st:
        line += (f"; decode: hit rate {100 * st['hit_rate']:.1f}%, {size(st['bytes_copied_per_token'])} copied and "
                 f"{st['cpu_experts_per_token']:.2f} CPU experts per token")
    pred = [f"{name} {x[key]:.1f}" for name, key in (("plan", "plan_decode_tok_s"), ("cost model", "cost_model_decode_tok_s"))
            if x.get(key)]
    if pred:
        line += f"; predicted decode tok/s: {', '.join(pred)} (measured {x['measured_decode_tok_s']:.1f})"
    return line


def render_profile(prof: dict[str, Any]) -> str:
    """Per-op ms per token, prefill and decode side by side."""
    ops = list(prof["decode"]["ms_per_token"])
    rows = []
    for op in ops:
        cells = [op]
        for phase in ("prefill", "decode"):
            ms = prof[phase]["ms_per_token"][op]
            total = sum(prof[phase]["ms_per_token"].values()) or 1.0
            cells += [f"{ms:.3f}", f"{100 * ms / total:.1f}%"]
        rows.append(cells)
    totals = ["total"] + [c for ph in ("prefill", "decode")
                          for c in (f"{sum(prof[ph]['ms_per_token'].values()):.3f}", "")]
    return "ms per token by op (last timed run):\n" + table(
        ["op", "prefill ms", "share", "decode ms", "share"], rows + [totals])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from(args)
    model = Path(args.model)
    if not model.exists():
        raise PocketMoEError(f"model file {model} does not exist; pass a GGUF file, shard, or directory.")
    if args.engine == "llama-cpp":
        return llama_child(args, s)
    from pocketmoe.parallel import init_parallel, under_torchrun

    if under_torchrun() and not init_parallel().is_lead:  # torchrun: rank 0 benches, the others run its steps
        from pocketmoe.engine.llm import LLM

        llm = LLM(model, n_ctx=s.n_ctx, threads=s.threads, chunk_size=s.chunk_size, backend=args.backend,
                  kv_dtype=s.kv_dtype, placement=placement_from_args(args), max_num_seqs=1)
        llm.runner.serve_steps()
        return 0
    report = run(model, s, args.backend, args.llama_cpp, args.bandwidth_mib, profile=args.profile,
                 placement=placement_from_args(args))
    print(json.dumps(report) if args.json else render(report, args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
