"""Inspect a GGUF model: summary, spec, validation, capability, and placement advice.

    python -m pocketmoe.inspect_gguf --gguf-path model.gguf --placement-report --num-gpus 1 --gpu-memory-gib 4

Without a section flag the summary is printed. `--json` prints one JSON object holding every section
(`summary`, `architecture`, `spec`, `validation`, `capability`, `placement`) whatever flags are given;
`placement` is `{"error": ...}` when the model cannot be placed. Exit codes: 0 ok, 1 validation failed
(with --validate-spec), 2 user error (missing or malformed file, unknown architecture, bad flags, or a
placement that cannot fit when --placement-report is asked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pocketmoe.cli_util import (
    EXIT_OK,
    EXIT_USER_ERROR,
    EXIT_VALIDATION,
    cuda_memory_bytes,
    error_line,
    run_cli,
)
from pocketmoe.gguf import open_bundle
from pocketmoe.hostinfo import host_memory_bytes
from pocketmoe.inspect_sections import (
    capability_text,
    load_spec,
    spec_text,
    summary,
    summary_text,
    validation,
    validation_text,
)
from pocketmoe.kv_dtypes import DEFAULT_KV_DTYPE, KV_DTYPE_BYTES
from pocketmoe.placement import Bandwidths, ComputeRates, PlacementError, PlanOptions, plan_report
from pocketmoe.placement.estimate import CPU_ATTENTION_GFLOPS_PER_CORE, default_cpu_gflops
from pocketmoe.placement.run import RunPlacement, run_plan

GIB = 2**30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.inspect_gguf",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("path", nargs="?", default=None, metavar="GGUF",
                   help="the model, as --gguf-path gives it (either one)")
    p.add_argument("--gguf-path", default=None, help="a GGUF file, any shard of a bundle, or a directory")
    p.add_argument("--architecture", default="auto",
                   help="spec to use; 'auto' = general.architecture; another name validates the file "
                        "against that spec and reports the mismatch as a validation error")
    s = p.add_argument_group("sections (none given: --summary)")
    s.add_argument("--summary", action="store_true", help="files, tensor bytes by type and by role")
    s.add_argument("--spec-summary", action="store_true", help="the spec's hyperparameters and counts")
    s.add_argument("--validate-spec", action="store_true", help="check tensors; exit 1 if any problem")
    s.add_argument("--capability-report", action="store_true", help="what PocketMoE can do with this file")
    s.add_argument("--placement-report", action="store_true", help="placement plan and decode estimates")
    s.add_argument("--json", action="store_true", help="one JSON object with every section")
    d = p.add_argument_group("devices and budget (placement)")
    d.add_argument("--num-gpus", type=int, default=None,
                   help="GPUs to plan for (0 = CPU only); default: as torch.cuda sees them, or the "
                        "number of --gpu-memory-gib sizes")
    d.add_argument("--gpu-memory-gib", default=None,
                   help="memory of each GPU in GiB: one size for all, or comma-separated per GPU; "
                        "required with --num-gpus > 0")
    d.add_argument("--host-memory-gib", type=float, default=None, help="default: MemTotal of /proc/meminfo")
    d.add_argument("--context-length", type=int, default=None,
                   help="tokens per sequence for the KV reserve; default 4096 or the model's if shorter")
    d.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    d.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, choices=list(KV_DTYPE_BYTES),
                   help=f"what the KV cache stores, as generate / bench / serve --kv-dtype (default {DEFAULT_KV_DTYPE})")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device the plan is for (cpu: the CPU stands in for it); auto: cuda when GPU sizes "
                        "are given or torch sees GPUs")
    d.add_argument("--mode", default="auto", choices=["auto", "all-device", "heterogeneous", "cpu"],
                   help="insist on a placement mode (auto: all-device when it fits)")
    d.add_argument("--expert-policy", default="auto", choices=["auto", "cache", "stage", "cpu"],
                   help="the dispatcher policy the run will use (which estimate applies)")
    d.add_argument("--expert-cache-slots", type=int, default=None, help="hot-expert cache slots per MoE layer")
    bw = Bandwidths()
    d.add_argument("--dram-gbps", type=float, default=bw.dram_gbps, help="host memory bandwidth, GB/s")
    d.add_argument("--pcie-gbps", type=float, default=bw.pcie_gbps, help="host-to-device copy bandwidth, GB/s")
    d.add_argument("--gpu-gbps", type=float, default=bw.gpu_gbps, help="device memory bandwidth, GB/s")
    d.add_argument("--cpu-gflops", type=float, default=None,
                   help=f"attention arithmetic the CPU sustains, GFLOP/s (default {CPU_ATTENTION_GFLOPS_PER_CORE:g} per "
                        f"core this process may use)")
    d.add_argument("--gpu-gflops", type=float, default=ComputeRates.gpu_gflops,
                   help="attention arithmetic the device sustains, GFLOP/s")
    return p


def _gpu_sizes(args: argparse.Namespace) -> list[float]:
    """GPU memory sizes in GiB from the flags, or from torch.cuda when no flag says otherwise."""
    sizes: list[float] | None = None
    if args.gpu_memory_gib is not None:
        try:
            sizes = [float(x) for x in str(args.gpu_memory_gib).split(",") if x.strip()]
        except ValueError:
            raise PlacementError(f"--gpu-memory-gib {args.gpu_memory_gib!r} is not a number or a "
                                 f"comma-separated list of numbers; give e.g. 4 or 22,22.") from None
    n = args.num_gpus
    if n is not None and n < 0:
        raise PlacementError(f"--num-gpus is {n}; give 0 for CPU only or a positive number of GPUs.")
    if n == 0:
        return []
    if sizes is None:
        if n is not None:
            raise PlacementError(f"--num-gpus {n} needs --gpu-memory-gib (the memory of each GPU in GiB, "
                                 f"e.g. --gpu-memory-gib 4).")
        return [b / GIB for b in cuda_memory_bytes()]
    n = len(sizes) if n is None else n
    if len(sizes) == 1:
        sizes = sizes * n
    if len(sizes) != n:
        raise PlacementError(f"--gpu-memory-gib gives {len(sizes)} sizes for {n} GPUs; give one size for "
                             f"all of them or one per GPU.")
    return sizes


def _options(args: argparse.Namespace, spec: Any) -> PlanOptions:
    ctx = args.context_length
    if ctx is None:
        ctx = min(4096, int(getattr(spec.config, "n_ctx", 4096) or 4096))
    try:
        bws = Bandwidths(args.dram_gbps, args.pcie_gbps, args.gpu_gbps)
    except ValueError as e:
        raise PlacementError(f"{e}; give --dram-gbps/--pcie-gbps/--gpu-gbps as positive GB/s.") from None
    try:
        cpu = default_cpu_gflops() if args.cpu_gflops is None else args.cpu_gflops
        rates = ComputeRates(cpu, args.gpu_gflops)
    except ValueError as e:
        raise PlacementError(f"{e}; give --cpu-gflops/--gpu-gflops as positive GFLOP/s.") from None
    return PlanOptions(context_length=ctx, batch=args.batch, kv_dtype=args.kv_dtype, bandwidths=bws, compute=rates)


def _plan(args: argparse.Namespace, spec: Any, bundle: Any) -> Any:
    """The plan run_plan makes for these flags: the one generate / bench / serve run with the same ones."""
    sizes = _gpu_sizes(args)
    host = args.host_memory_gib if args.host_memory_gib is not None else host_memory_bytes() / GIB
    mode = "cpu" if not sizes and args.mode == "auto" and args.device != "cpu" else args.mode
    rp = RunPlacement(device=args.device, mode=mode, gpu_memory_gib=tuple(sizes) or None,
                      expert_policy=args.expert_policy, expert_cache_slots=args.expert_cache_slots)
    return run_plan(spec, bundle.tensors, rp, _options(args, spec), host_memory_bytes=int(host * GIB), plan_only=True)


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str], int]:
    """Every requested section as JSON-able data and as text, and the exit code."""
    wanted = {k: getattr(args, k) for k in ("summary", "spec_summary", "validate_spec",
                                             "capability_report", "placement_report")}
    if not any(wanted.values()):
        wanted["summary"] = True
    everything = args.json
    data: dict[str, Any] = {}
    text: dict[str, str] = {}
    code = EXIT_OK
    with open_bundle(args.gguf_path) as bundle:
        file_arch = bundle.architecture
        spec = load_spec(bundle, args.architecture)
        data["architecture"] = spec.architecture
        if everything or wanted["summary"]:
            data["summary"] = summary(bundle, spec)
            text["summary"] = summary_text(data["summary"])
        if everything or wanted["spec_summary"]:
            data["spec"] = spec.describe()
            text["spec"] = spec_text(data["spec"])
        if everything or wanted["validate_spec"]:
            data["validation"] = validation(spec, bundle, file_arch)
            text["validation"] = validation_text(data["validation"])
            if wanted["validate_spec"] and not data["validation"]["ok"]:
                code = EXIT_VALIDATION
        if everything or wanted["capability_report"]:
            data["capability"] = spec.capability()
            text["capability"] = capability_text(data["capability"])
        if everything or wanted["placement_report"]:
            try:
                plan = _plan(args, spec, bundle)
            except PlacementError as e:
                if not args.json:
                    raise
                data["placement"] = {"error": " ".join(str(e).split())}
                if wanted["placement_report"]:
                    print(error_line(e), file=sys.stderr)
                    code = EXIT_USER_ERROR
            else:
                data["placement"] = plan.to_json()
                text["placement"] = plan_report(plan)
    return data, text, code


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, with the model path from --gguf-path or the positional GGUF (one of them, or both the same)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.gguf_path is None and args.path is None:
        p.error("no model given; name the GGUF file, e.g. `python -m pocketmoe.inspect_gguf model.gguf` "
                "or `--gguf-path model.gguf`")
    if args.gguf_path is not None and args.path is not None and args.gguf_path != args.path:
        p.error(f"two models given ({args.path!r} and --gguf-path {args.gguf_path!r}); give one")
    args.gguf_path = args.gguf_path if args.gguf_path is not None else args.path
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    data, text, code = collect(args)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n\n".join(text.values()))
    return code


if __name__ == "__main__":
    sys.exit(run_cli(main))
