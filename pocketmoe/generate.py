"""Generate text from a GGUF model on this machine.

    python -m pocketmoe.generate [--model PATH] (--prompt TEXT | --file PATH | --chat TEXT | --token-ids 1,2,3)
        [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]
        [--threads N] [--n-ctx C] [--stop STR ...] [--json] [--dump-logits FILE.npy] [--prefix-cache-dir DIR]
        [--json-schema SCHEMA | --json-schema-file FILE | --grammar GBNF | --grammar-file FILE | --regex RE]
        [--device auto|cpu|cuda] [--mode auto|all-device|heterogeneous|cpu] [--gpu-memory-gib G[,G...]]
        [--expert-policy auto|cache|stage|cpu] [--expert-cache-slots N]

Text streams to stdout; `--json` prints one object instead. prefill_tok_s = prompt tokens computed / prefill
wall time (with --dump-logits the whole prompt was computed for the dump, and generation continues from its rows:
cached_tokens); decode_tok_s = tokens after the first / their wall time; loading is excluded from both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pocketmoe.cli_util import add_placement_args, int_list, placement_from_args, read_text_file, run_cli
from pocketmoe.defaults import DEFAULT_CHUNK_SIZE
from pocketmoe.foreign_flags import parse_args_with_foreign_flags, print_notes

if TYPE_CHECKING:
    from pocketmoe.engine.structured import Grammar


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, any shard of a bundle, or its directory (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="raw text prompt (BOS added as the file asks)")
    src.add_argument("--file", "-f", help="--prompt read from this file (llama-cli's -f)")
    src.add_argument("--chat", help="one user message, rendered with the model's chat template")
    src.add_argument("--token-ids", help="comma-separated prompt token ids (no BOS added)")
    add_sampling_args(p, max_tokens=128, temperature=0.0)
    g = p.add_mutually_exclusive_group()  # structured output (llama.cpp's flags, and a regex)
    g.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON following this JSON schema ('{}': any)")
    g.add_argument("--json-schema-file", metavar="FILE", help="--json-schema read from a file")
    g.add_argument("--grammar", metavar="GBNF", help="the output follows this grammar (llama.cpp's GBNF, or Lark)")
    g.add_argument("--grammar-file", metavar="FILE", help="--grammar read from a file")
    g.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    add_runtime_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--dump-logits", metavar="FILE.npy",
                   help="write float32 [n_prompt_tokens, vocab] logits of every prompt position")
    add_placement_args(p)
    return parse_args_with_foreign_flags(p, argv, server=False)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """The sampling flags (generate's and chat's); sampling_params reads them."""
    from pocketmoe.engine.sampler import SAMPLING_DEFAULTS as D

    p.add_argument("--max-tokens", "-n", "--n-predict", type=int, default=max_tokens)
    p.add_argument("--temperature", "--temp", type=float, default=temperature,
                   help=f"0 = greedy (default {temperature:g})")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", "-s", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repeat-last-n", type=int, default=0, dest="penalty_last_n",
                   help="the penalties look at this many last tokens (default 0: all of them)")
    g = p.add_argument_group("llama.cpp's other samplers", "llama-cli's flags; with any of them on, or --samplers, "
                             "the steps run in llama.cpp's chain (the temperature after the filters)")
    g.add_argument("--typical", type=float, default=D["typical_p"], dest="typical_p",
                   help="locally typical p (1: off)")
    g.add_argument("--top-nsigma", type=float, default=D["top_n_sigma"], dest="top_n_sigma",
                   help="top-n-sigma (<= 0: off)")
    g.add_argument("--xtc-probability", type=float, default=D["xtc_probability"])
    g.add_argument("--xtc-threshold", type=float, default=D["xtc_threshold"])
    g.add_argument("--dynatemp-range", type=float, default=D["dynatemp_range"])
    g.add_argument("--dynatemp-exp", type=float, default=D["dynatemp_exponent"], dest="dynatemp_exponent")
    g.add_argument("--dry-multiplier", type=float, default=D["dry_multiplier"])
    g.add_argument("--dry-base", type=float, default=D["dry_base"])
    g.add_argument("--dry-allowed-length", type=int, default=D["dry_allowed_length"])
    g.add_argument("--dry-penalty-last-n", type=int, default=D["dry_penalty_last_n"],
                   help="-1: the whole history, 0: off")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, dest="dry_sequence_breakers",
                   metavar="TEXT", help="repeatable; replaces the defaults (newline, colon, quote, asterisk)")
    g.add_argument("--mirostat", type=int, default=0, choices=(0, 1, 2))
    g.add_argument("--mirostat-lr", type=float, default=D["mirostat_eta"], dest="mirostat_eta")
    g.add_argument("--mirostat-ent", type=float, default=D["mirostat_tau"], dest="mirostat_tau")
    g.add_argument("--min-keep", type=int, default=D["min_keep"],
                   help="top-p, min-p, typical and XTC each leave at least this many tokens")
    order = g.add_mutually_exclusive_group()
    order.add_argument("--samplers", default=None, metavar="NAMES",
                       help="the chain, llama.cpp's names split by ';' (e.g. 'penalties;top_k;top_p;temperature')")
    order.add_argument("--sampling-seq", default=None, metavar="LETTERS", help="the chain as letters (e.g. 'ekpt')")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Threads, context, prefill chunk and op backend (generate's and chat's)."""
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--n-ctx", "--ctx-size", "-c", type=int, default=4096, help="context length (prompt + generated)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"prefill tokens per forward pass (default {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "reference"])
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep the prompt's computed KV pages in files here, so a later run with the same start reads "
                   "them instead of computing them again (llama-cli's --prompt-cache, by content)")


def sampling_params(args: argparse.Namespace, grammar: Grammar | None = None):  # noqa: ANN201
    """The SamplingParams add_sampling_args' flags give (SamplingParamsError, one line, where one is out of range)."""
    from pocketmoe.engine.sampler import (
        DRY_BREAKERS,
        LLAMA_CHAIN,
        LLAMA_EXTRA_DEFAULTS,
        MIROSTAT_CHAIN,
        SamplingParams,
        SamplingParamsError,
        llama_extras_on,
        sampler_chain,
    )

    extras = {name: getattr(args, name) for name in (*LLAMA_EXTRA_DEFAULTS, "mirostat", "mirostat_tau", "mirostat_eta",
                                                     "min_keep")}
    extras["dry_sequence_breakers"] = tuple(args.dry_sequence_breakers or DRY_BREAKERS)
    order = args.samplers.split(";") if args.samplers is not None else args.sampling_seq
    try:
        chain = sampler_chain(order) if order is not None else None
    except ValueError as e:
        raise SamplingParamsError(f"--{'samplers' if args.samplers is not None else 'sampling-seq'} {e}") from None
    if args.mirostat:
        chain = MIROSTAT_CHAIN
    elif chain is None and llama_extras_on(extras):
        chain = LLAMA_CHAIN
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, penalty_last_n=args.penalty_last_n, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos, grammar=grammar, chain=chain,
        **extras)


def parse_token_ids(text: str) -> list[int]:
    return int_list(text, "--token-ids", "token id")


def grammar_from_args(args: argparse.Namespace) -> Grammar | None:
    """The structured output the flags ask for (None: free text); a clear error for a file or schema that fails."""
    from pocketmoe.engine.structured import Grammar, GrammarError

    flags = (("json", args.json_schema, False), ("json", args.json_schema_file, True), ("gbnf", args.grammar, False),
             ("gbnf", args.grammar_file, True), ("regex", args.regex, False))  # one at most: argparse's group
    kind, text, from_file = next((f for f in flags if f[1] is not None), ("", None, False))
    if text is None:
        return None
    if from_file:
        try:
            text = Path(text).read_text(encoding="utf-8")
        except OSError as e:
            raise GrammarError(f"cannot read the grammar file {text}: {e.strerror}.") from None
    if kind == "regex":
        return Grammar.regex(text)
    if kind == "gbnf":
        return Grammar("gbnf", text)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not JSON ({e}); pass a schema such as '{{\"type\": \"object\"}}'.") \
            from None
    return Grammar.json_object() if schema == {} else Grammar.json_schema(schema)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print_notes(args)
    grammar = grammar_from_args(args)
    from pocketmoe.engine.llm import LLM, CompletionOutput
    from pocketmoe.memstat import MemoryWatch

    params = sampling_params(args, grammar)
    mem = MemoryWatch()
    t_load = time.perf_counter()
    if args.model is None:
        from pocketmoe.demo_model import demo_model_path

        args.model = str(demo_model_path())
    placement = placement_from_args(args)
    llm = LLM(args.model, n_ctx=args.n_ctx, threads=args.threads, chunk_size=args.chunk_size,
              backend=args.backend, kv_dtype=args.kv_dtype, placement=placement, max_num_seqs=1,
              prefix_cache_dir=args.prefix_cache_dir)
    if not llm.runner.parallel.is_lead:  # torchrun: rank 0 generates, the other ranks run its steps
        llm.runner.serve_steps()
        return 0
    load_s = time.perf_counter() - t_load
    if not args.json:
        print(f"[pocketmoe] {llm.bundle.architecture} from {llm.bundle.paths[0].name}: kernels "
              f"{llm.backend_name} ({llm.backend_detail}), loaded in {load_s:.2f} s", file=sys.stderr)
    if args.chat is not None:
        prompt = llm.encode_chat([{"role": "user", "content": args.chat}])
    elif args.token_ids is not None:
        prompt = parse_token_ids(args.token_ids)
    else:
        prompt = llm.encode_prompt(args.prompt if args.file is None else read_text_file(args.file, "--file"))

    if args.dump_logits:
        import numpy as np

        np.save(args.dump_logits, llm.prompt_logits(prompt).numpy().astype(np.float32))
    out = CompletionOutput(prompt_token_ids=[])
    for chunk in llm.stream(prompt, params, out):
        mem.sample()
        if not args.json and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    mem.sample()
    llm.runner.stop_workers()  # tensor parallel: the other ranks are done
    stats = {
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.cached_tokens,
        "completion_tokens": len(out.token_ids),
        "prefill_tok_s": round(out.prefill_tok_s, 3),
        "decode_tok_s": round(out.decode_tok_s, 3),
        "ttft_s": round(out.ttft_s, 4),
        "load_s": round(load_s, 3),
        "peak_rss_mib": round(mem.peak_rss_mib, 1),
        "peak_anon_mib": round(mem.peak_anon_mib, 1),
        "kv_cache_mib": round(llm.runner.cache.nbytes / 2**20, 1),
        "kv_dtype": args.kv_dtype,
        "finish_reason": out.finish_reason,
        "backend": llm.backend_name,
        "mode": llm.runner.plan.mode,
    }
    from pocketmoe.experts.report import expert_report

    experts = expert_report(llm.runner)
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, **stats, "experts": experts},
                         ensure_ascii=False))
    else:
        print(file=sys.stdout)
        print("[pocketmoe] " + ", ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
