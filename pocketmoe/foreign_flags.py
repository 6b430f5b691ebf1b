"""Other engines' command-line flags (llama-server's, llama-cli's, `vllm serve`'s), for a user's script or service
file that passes them.

`serve` takes llama-server's and vLLM's, `generate` and `chat` the llama.cpp ones a llama-cli line carries too
(placement, cache type, batch; their sampling flags are spelled as llama-cli's already). Each is one of these kinds
here:
- **mapped**: it means one of this server's own flags, which it then sets (`-ngl 0`: `--device cpu`; `-ot exps=CPU`,
  `--cpu-moe`: routed experts in host memory, `--mode heterogeneous`; `-ctk f16`: `--kv-dtype f16`; `-ub N`:
  `--chunk-size N`; `-v`: `--log-level debug`; `--api-key-file`: `--api-key`; `--chat-template-kwargs`: the
  variables every chat renders with unless its request sets them);
- **noted**: this server always does what it asks, or it does not apply (`--jinja`, `-fa`, `--cont-batching`,
  `--metrics`, `--mlock`, `--no-mmap`, `-b`, `-tb`, `--cache-reuse`, `--no-context-shift`, `-sm`, `-ts`, ...): taken,
  with one line saying so at start;
- **sampling defaults**: `--temp`, `--top-k`, `--top-p`, `--min-p`, `--repeat-penalty`, `--presence-penalty`,
  `--frequency-penalty`, `--seed` give the default of that field on every route, as llama-server's do (a request's
  own value wins; GET /props shows them);
- **refused**: it asks for what this server does not do (`--context-shift`, a quantized KV cache, a draft model,
  downloads, a server-wide length): one line saying why and what to do, before anything loads.
Where one of this server's own flags is given too and says otherwise, the command line is refused.

vLLM's `vllm serve MODEL ...` line: the model may come first, without -m; `--gpu-memory-utilization F` plans with F
of each GPU's memory (`--gpu-memory-gib`), `--max-num-batched-tokens` is `--chunk-size`, `--uvicorn-log-level` is
`--log-level`; `--trust-remote-code`, `--dtype`, `--quantization`, `--tokenizer` (the GGUF file's own is used),
`--enforce-eager`, `--enable-chunked-prefill`, `--enable-auto-tool-choice`, `--tool-call-parser`, ... are noted; a
quantized `--kv-cache-dtype`, `--pipeline-parallel-size` over 1, speculative decoding and LoRA are refused.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from pocketmoe.errors import PocketMoEError

# flags always honoured here, or that do not apply: (flags, nargs, what happens instead, server's only)
NOTED: tuple[tuple[tuple[str, ...], str | int, str, bool], ...] = (
    (("--jinja",), 0, "chat templates always render with jinja2 here", False),
    (("-fa", "--flash-attn"), "?", "attention always runs fused over chunks of the cache here", False),
    (("-cb", "--cont-batching"), 0, "requests are always batched together here", True),
    (("-nocb", "--no-cont-batching"), 0, "requests are always batched together here", True),
    (("--metrics",), 0, "GET /metrics is always served here", True),
    (("--no-webui", "--webui"), 0, "this server has no web UI", True),
    (("--mlock",), 0, "weights stay memory-mapped from the file; the OS keeps them while memory allows", False),
    (("--no-mmap", "--mmap"), 0, "weights are always memory-mapped from the file here", False),
    (("-b", "--batch-size"), 1, "a step's prompt tokens are --chunk-size (llama-server's -ub)", False),
    (("-tb", "--threads-batch"), 1, "one --threads count serves prompts and generation", False),
    (("--cache-reuse",), 1, "the prefix cache reuses a prompt's computed start on its own (--enable-prefix-caching)",
     True),
    (("--no-context-shift",), 0, "the context is never shifted here: a full context ends the reply", False),
    (("--keep",), 1, "the context is never shifted here, so there is nothing to keep", False),
    (("-sm", "--split-mode"), 1, "several GPUs are planned by memory here (--gpu-memory-gib), or run tensor "
                                 "parallel under torchrun", False),
    (("-ts", "--tensor-split"), 1, "several GPUs are planned by memory here (--gpu-memory-gib)", False),
    (("-mg", "--main-gpu"), 1, "every visible GPU is planned for here (CUDA_VISIBLE_DEVICES picks them)", False),
    (("--no-warmup",), 0, "there is no warm-up run here", False),
    (("--threads-http",), 1, "one event loop serves every connection here", True),
    (("-to", "--timeout"), 1, "connections are kept open while a reply runs (streams send keep-alives)", True),
    (("--log-disable",), 0, "only warnings and errors are logged unless --log-level says otherwise", True),
    (("--fit",), "?", "the placement plan always fits the weights, cache and KV pool to memory here", False),
    (("--swa-full",), 0, "these models have no sliding-window attention", False),
    (("--props",), 0, "POST /props is not served; GET /props is", True),
    (("--rerank", "--reranking"), 0, "POST /rerank is always served here", True),
)

# flags that ask for what is not done here: (flags, nargs, why and what to do, server's only)
REFUSED: tuple[tuple[tuple[str, ...], str | int, str, bool], ...] = (
    (("--context-shift",), 0, "the context is never shifted here (a full context ends the reply with finish_reason "
                              "length); raise --ctx-size instead", False),
    (("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"), 1,
     "nothing is downloaded here; download the GGUF file and give it with -m", False),
    (("-md", "--model-draft", "--spec-type", "--draft-max", "--draft", "--draft-n", "--draft-min"), 1,
     "speculative decoding is not supported here; drop the draft-model flags", False),
    (("--lora", "--lora-scaled", "--control-vector"), 1, "LoRA adapters and control vectors are not supported here",
     False),
    (("--mmproj", "-mm"), 1, "these models take text only; drop --mmproj", False),
    (("-n", "--n-predict", "--predict"), 1, "each route keeps its own default length (/completion: to the end of "
                                            "the context, /v1/chat/completions: the same, /v1/completions: 16); "
                                            "send max_tokens (or n_predict) in the request body", True),
)

# llama-server's sampling flags: the default of each request field of that name on every route (flags, field, type)
SAMPLING: tuple[tuple[tuple[str, ...], str, type], ...] = (
    (("--temp", "--temperature"), "temperature", float), (("--top-k",), "top_k", int), (("--top-p",), "top_p", float),
    (("--min-p",), "min_p", float), (("--repeat-penalty",), "repeat_penalty", float),
    (("--presence-penalty",), "presence_penalty", float), (("--frequency-penalty",), "frequency_penalty", float),
    (("-s", "--seed"), "seed", int),
)

KV_TYPES = ("f32", "f16", "bf16")

# vllm serve's flags that change nothing here: (flags, nargs, what happens instead)
VLLM_NOTED: tuple[tuple[tuple[str, ...], str | int, str], ...] = (
    (("--trust-remote-code",), 0, "a GGUF file holds no code to run"),
    (("--dtype",), 1, "weights stay in the GGUF file's own types, activations in float32"),
    (("--quantization",), 1, "the GGUF file's types are its quantization"),
    (("--load-format",), 1, "a GGUF file is read as it is"),
    (("--tokenizer", "--tokenizer-mode"), 1, "the GGUF file's own tokenizer is used"),
    (("--hf-config-path",), 1, "the GGUF file's metadata is the model's config"),
    (("--enforce-eager",), 0, "CUDA graphs are captured only where a decode step's shape allows"),
    (("--enable-chunked-prefill",), 0, "prompts are always computed in --chunk-size chunks beside running decodes"),
    (("--disable-log-requests", "--disable-log-stats"), 0, "requests are logged only at --log-level debug"),
    (("--swap-space",), 1, "a preempted sequence is recomputed, not swapped"),
    (("--block-size",), 1, "KV pages hold 16 positions here"),
    (("--enable-auto-tool-choice",), 0, "tool calls are parsed, in the chat template's format, whenever a request "
                                        "sends tools"),
    (("--tool-call-parser",), 1, "the tool-call format is read from the chat template"),
    (("--reasoning-parser",), 1, "reasoning blocks are split as --reasoning-format says"),
    (("--generation-config",), 1, "request defaults come from this server's flags (--temp ...)"),
    (("--disable-frontend-multiprocessing",), 0, "one process serves every request here"),
)
VLLM_REFUSED: tuple[tuple[tuple[str, ...], str | int, str], ...] = (
    (("--speculative-config", "--speculative-model"), 1, "speculative decoding is not supported here"),
    (("--enable-lora", "--lora-modules"), "*", "LoRA adapters are not supported here"),
)


def _tables(server: bool) -> tuple[list[tuple[tuple[str, ...], str | int, str]], ...]:
    """NOTED and REFUSED's rows for the server (all) or a CLI (those not the server's only)."""
    return tuple([(flags, nargs, why) for flags, nargs, why, only in table if server or not only]
                 for table in (NOTED, REFUSED))


def add_foreign_flags(p: argparse.ArgumentParser, server: bool = True) -> None:
    """llama-server's flags (module docstring; a CLI's: those a llama-cli line carries too), in a group of their
    own."""
    noted_rows, refused_rows = _tables(server)
    noted = ", ".join(_name(flags) for flags, _, _ in noted_rows)
    refused = ", ".join(_name(flags) for flags, _, _ in refused_rows)
    g = p.add_argument_group(f"{'llama-server' if server else 'llama-cli'}'s flags", "taken as llama.cpp takes them "
                             "where they mean one of the flags above (these); taken with a note where they ask for "
                             f"what is always done here or do not apply ({noted}); refused with the reason where "
                             f"they ask for what is not done here ({refused})")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="llama_ngl", default=None, metavar="N",
                   help="0: run on the CPU alone (--device cpu); more, all or auto: the GPUs as planned by memory")
    g.add_argument("-ot", "--override-tensor", dest="llama_ot", action="append", default=None, metavar="PAT=BUFT",
                   help="exps=CPU (routed experts in host memory): --mode heterogeneous; other rules are noted")
    g.add_argument("-cmoe", "--cpu-moe", dest="llama_cpu_moe", action="store_true",
                   help="routed experts in host memory: --mode heterogeneous")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="llama_n_cpu_moe", type=int, default=None, metavar="N",
                   help="routed experts in host memory (every layer's, with a hot-expert cache on the GPU): "
                        "--mode heterogeneous")
    g.add_argument("-ctk", "--cache-type-k", dest="llama_ctk", default=None, metavar="TYPE",
                   help=f"the KV cache's type, one of {', '.join(KV_TYPES)}: --kv-dtype")
    g.add_argument("-ctv", "--cache-type-v", dest="llama_ctv", default=None, metavar="TYPE",
                   help="as -ctk (DeepSeek's latent cache has one type for both)")
    g.add_argument("-ub", "--ubatch-size", dest="llama_ubatch", type=int, default=None, metavar="N",
                   help="prompt tokens per step: --chunk-size")
    _add_hidden(g, (*noted_rows, *refused_rows))
    if not server:
        return
    g.add_argument("-v", "--verbose", "--log-verbose", dest="llama_verbose", action="store_true",
                   help="--log-level debug")
    g.add_argument("--api-key-file", dest="llama_api_key_file", default=None, metavar="FILE",
                   help="the API key, the file's first line (--api-key)")
    g.add_argument("--chat-template-kwargs", dest="chat_template_kwargs", default=None, metavar="JSON",
                   help="a JSON object of variables every chat template renders with, unless the request's own "
                        "chat_template_kwargs (or reasoning_effort) sets them; e.g. '{\"enable_thinking\": false}'")
    for flags, field, kind in SAMPLING:
        g.add_argument(*flags, dest=_dest(flags), type=kind, default=None, metavar="X",
                       help=f"the default of every request's {field} (a request's own wins)")
    v = p.add_argument_group("vllm serve's flags", "taken where they mean one of the flags above (these); taken "
                             "with a note where they ask for what is always done here or do not apply "
                             f"({', '.join(_name(f) for f, _, _ in VLLM_NOTED)}); refused with the reason where "
                             f"they ask for what is not done here ({', '.join(_name(f) for f, _, _ in VLLM_REFUSED)})")
    v.add_argument("model_first", nargs="?", default=None, metavar="MODEL",
                   help="the model, first as `vllm serve MODEL` gives it (the same as -m)")
    v.add_argument("--gpu-memory-utilization", dest="vllm_gpu_util", type=float, default=None, metavar="F",
                   help="plan with this fraction of each GPU's memory (--gpu-memory-gib)")
    v.add_argument("--max-num-batched-tokens", dest="vllm_batched", type=int, default=None, metavar="N",
                   help="prompt tokens per step: --chunk-size")
    v.add_argument("--kv-cache-dtype", dest="vllm_kv", default=None, metavar="TYPE",
                   help="auto: --kv-dtype's default; quantized types are refused")
    v.add_argument("--uvicorn-log-level", dest="vllm_log", default=None, metavar="LEVEL", help="--log-level")
    v.add_argument("--pipeline-parallel-size", "-pp", dest="vllm_pp", type=int, default=None, metavar="N",
                   help="1 only (several GPUs run tensor parallel under torchrun)")
    _add_hidden(v, (*VLLM_NOTED, *VLLM_REFUSED))


def _add_hidden(g: Any, rows: Sequence[tuple[tuple[str, ...], str | int, str]]) -> None:
    """The noted and refused flags, taken but left out of --help (the group's description lists them)."""
    for flags, nargs, _ in rows:
        kw: dict[str, Any] = {"action": "store_true"} if nargs == 0 else {"nargs": nargs, "metavar": "X"}
        if nargs == "?":
            kw["const"] = True  # given without a value
        g.add_argument(*flags, dest=_dest(flags), default=None, help=argparse.SUPPRESS, **kw)


def _notes(args: argparse.Namespace, noted: Sequence[tuple[tuple[str, ...], str | int, str]],
           refused: Sequence[tuple[tuple[str, ...], str | int, str]], engine: str) -> list[str]:
    """A note for each noted flag given; PocketMoEError for the first refused one given."""
    for flags, _, why in refused:
        if getattr(args, _dest(flags)) not in (None, False):
            raise PocketMoEError(f"{_name(flags)}: {why}.")
    return [f"{_name(flags)} is taken as {engine}'s but changes nothing: {why}."
            for flags, _, why in noted if getattr(args, _dest(flags)) not in (None, False)]


def apply_foreign_flags(args: argparse.Namespace, defaults: dict[str, Any], server: bool = True) -> list[str]:
    """Set this tool's flags from the llama.cpp flags add_foreign_flags(p, server) took; returns the notes to print
    at start. PocketMoEError (one line) for a refused flag, a value that cannot be taken here, or a clash with a flag
    of this tool's own (`defaults`: the parser's defaults, to tell a flag given from one left alone)."""
    notes = _notes(args, *_tables(server), "llama.cpp")

    def put(name: str, value: Any, flag: str) -> None:
        mine = getattr(args, name)
        if mine != defaults[name] and mine != value:
            raise PocketMoEError(f"{flag} asks for --{name.replace('_', '-')} {value} but --{name.replace('_', '-')} "
                                 f"{mine} was given too; give one of them.")
        setattr(args, name, value)

    if args.llama_ngl is not None:
        ngl = str(args.llama_ngl).strip().lower()
        if not (ngl in ("auto", "all") or ngl.lstrip("-").isdigit()):
            raise PocketMoEError(f"-ngl {args.llama_ngl!r} is not a layer count, auto or all; give e.g. -ngl 99, or "
                                 "-ngl 0 for the CPU alone.")
        if ngl.lstrip("-").isdigit() and int(ngl) == 0:
            put("device", "cpu", "-ngl 0")
        else:
            notes.append(f"-ngl {args.llama_ngl}: the GPUs are used (if any) as the placement plan fits the model to "
                         "their memory, not by layer count; see --mode and --gpu-memory-gib.")
    host_experts = args.llama_cpu_moe or args.llama_n_cpu_moe is not None
    for rule in args.llama_ot or ():
        pattern, _, buft = rule.partition("=")
        if "exps" in pattern and buft.strip().upper() == "CPU":
            host_experts = True
        else:
            notes.append(f"-ot {rule}: only routed experts on the CPU (exps=CPU) is taken here; the placement plan "
                         "puts every other tensor.")
    if host_experts and args.device != "cpu" and gpu_memory_gib():
        put("mode", "heterogeneous", "-ot exps=CPU / --cpu-moe")
        notes.append("routed experts stay in host memory (--mode heterogeneous): each step computes a missed expert "
                     "on the CPU or copies it to the GPU, whichever the cost model finds faster.")
    elif host_experts:
        notes.append("-ot exps=CPU / --cpu-moe: no GPU is in use, so every weight, the routed experts too, is read "
                     "from host memory already.")
    kv = {t.lower() for t in (args.llama_ctk, args.llama_ctv) if t is not None}
    if kv:
        bad = sorted(kv - set(KV_TYPES))
        if bad:
            raise PocketMoEError(f"-ctk/-ctv {bad[0]}: the KV cache here holds {', '.join(KV_TYPES)}; give -ctk f16 "
                                 "(half of f32's memory, as llama.cpp's default).")
        if len(kv) > 1:
            raise PocketMoEError(f"-ctk and -ctv differ ({' and '.join(sorted(kv))}), but the cache here has one type; "
                                 "give the same to both.")
        put("kv_dtype", kv.pop(), "-ctk")
    if args.llama_ubatch is not None:
        if args.llama_ubatch < 1:
            raise PocketMoEError(f"-ub must be >= 1, got {args.llama_ubatch}.")
        put("chunk_size", args.llama_ubatch, "-ub")
    if not server:
        return notes
    if args.llama_verbose:
        put("log_level", "debug", "-v")
    if args.llama_api_key_file is not None:
        try:
            with open(args.llama_api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise PocketMoEError(f"--api-key-file {args.llama_api_key_file}: {e.strerror or e}; give a file this user "
                                 "can read.") from None
        if not key:
            raise PocketMoEError(f"--api-key-file {args.llama_api_key_file}: its first line is empty; write the key "
                                 "there.")
        put("api_key", key, "--api-key-file")
    args.chat_template_kwargs = template_kwargs(args.chat_template_kwargs)
    args.sampling_defaults = sampling_defaults(args)
    return notes + vllm_flags(args, put)


def vllm_flags(args: argparse.Namespace, put: Any) -> list[str]:
    """apply_foreign_flags' part for vllm serve's flags (put: its setter of this server's own flags)."""
    notes = _notes(args, VLLM_NOTED, VLLM_REFUSED, "vLLM")
    if args.model_first is not None:
        put("model", args.model_first, f"the model {args.model_first} given first")
    if args.vllm_pp is not None and args.vllm_pp != 1:
        raise PocketMoEError(f"--pipeline-parallel-size {args.vllm_pp}: pipeline parallelism is not supported here; "
                             "run tensor parallel under torchrun --nproc-per-node N instead.")
    if args.vllm_batched is not None:
        if args.vllm_batched < 1:
            raise PocketMoEError(f"--max-num-batched-tokens must be >= 1, got {args.vllm_batched}.")
        put("chunk_size", args.vllm_batched, "--max-num-batched-tokens")
    if args.vllm_kv is not None:
        kv = args.vllm_kv.lower()
        if kv in ("bfloat16", "float16", "float32"):
            kv = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[kv]
        if kv in KV_TYPES:
            put("kv_dtype", kv, "--kv-cache-dtype")
        elif kv != "auto":
            raise PocketMoEError(f"--kv-cache-dtype {args.vllm_kv}: the KV cache here holds {', '.join(KV_TYPES)}; "
                                 "give auto, or --kv-dtype f16 for half of f32's memory.")
    if args.vllm_log is not None:
        level = {"trace": "debug", "critical": "error"}.get(args.vllm_log.lower(), args.vllm_log.lower())
        if level not in ("debug", "info", "warning", "error"):
            raise PocketMoEError(f"--uvicorn-log-level {args.vllm_log} is not a log level; give debug, info, warning "
                                 "or error.")
        put("log_level", level, "--uvicorn-log-level")
    if args.vllm_gpu_util is not None:
        f = args.vllm_gpu_util
        if not 0 < f <= 1:
            raise PocketMoEError(f"--gpu-memory-utilization {f} is not in (0, 1]; give the fraction of each GPU's "
                                 "memory to plan with, e.g. 0.9.")
        sizes = gpu_memory_gib()
        if sizes:
            put("gpu_memory_gib", ",".join(f"{f * g:.2f}" for g in sizes), "--gpu-memory-utilization")
        else:
            notes.append("--gpu-memory-utilization: no GPU is visible, so there is no GPU memory to plan with.")
    return notes


def gpu_memory_gib() -> list[float]:
    """Each visible GPU's memory, GiB (none without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


def parse_args_with_foreign_flags(p: argparse.ArgumentParser, argv: Sequence[str] | None, server: bool = True
                                ) -> argparse.Namespace:
    """p's arguments with llama.cpp's flags taken (add_foreign_flags, apply_foreign_flags); a refused one is p's usage
    error. The notes to print at start are in `foreign_notes`."""
    add_foreign_flags(p, server)
    args = p.parse_args(argv)
    names = ("device", "mode", "kv_dtype", "chunk_size",
             *(("log_level", "api_key", "model", "gpu_memory_gib") if server else ()))
    try:
        args.foreign_notes = apply_foreign_flags(args, {name: p.get_default(name) for name in names}, server)
    except PocketMoEError as e:
        p.error(str(e))
    return args


def print_notes(args: argparse.Namespace) -> None:
    """The notes apply_foreign_flags gave, one line each on stderr."""
    for note in getattr(args, "foreign_notes", ()):
        print(f"note: {note}", file=sys.stderr, flush=True)


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields' defaults the sampling flags give, checked as a request's fields are (PocketMoEError)."""
    from pydantic import ValidationError

    from pocketmoe.serve.protocol import SamplingFields

    out = {}
    for flags, field, _ in SAMPLING:
        value = getattr(args, _dest(flags))
        if value is None:
            continue
        try:
            SamplingFields.model_validate({field: value})
        except ValidationError as e:
            raise PocketMoEError(f"{_name(flags)} {value}: {e.errors()[0]['msg'].lower()}; give a value a request's "
                                 f"{field} may take.") from None
        out[field] = value
    return out


def template_kwargs(text: str | None) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object (PocketMoEError naming what is wrong)."""
    from pocketmoe.serve.protocol import RESERVED_TEMPLATE_VARIABLES

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise PocketMoEError(f"--chat-template-kwargs is not JSON ({e}); give an object, e.g. "
                             "'{\"enable_thinking\": false}'.") from None
    if not isinstance(value, dict):
        raise PocketMoEError(f"--chat-template-kwargs is a JSON {type(value).__name__}, not an object; give e.g. "
                             "'{\"enable_thinking\": false}'.")
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & set(value))
    if clash:
        raise PocketMoEError(f"--chat-template-kwargs may not set {', '.join(clash)}; each request's own fields do.")
    return value


def _name(flags: tuple[str, ...]) -> str:
    """A flag's name in messages: its first long spelling."""
    return next((f for f in flags if f.startswith("--")), flags[0])


def _dest(flags: tuple[str, ...]) -> str:
    return "foreign_" + re.sub(r"\W", "_", max(flags, key=len).lstrip("-"))
