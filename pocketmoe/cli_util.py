"""Helpers every entry point shares: one-line user errors with exit codes, sizes, tables, host facts."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pocketmoe.errors import PocketMoEError
from pocketmoe.kv_dtypes import DEFAULT_KV_DTYPE, KV_DTYPE_BYTES

EXIT_OK = 0
EXIT_VALIDATION = 1  # the file was read but does not pass the checks asked for
EXIT_USER_ERROR = 2  # bad file, bad flag, a budget that cannot fit (same code argparse uses)
GIB = 2**30


def error_line(err: BaseException) -> str:
    """`error: <message>` on one line (newlines folded), the form every CLI prints for user errors."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"error: {text}"


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run `main`; a PocketMoEError or an OS error about a path becomes one stderr line and exit 2."""
    try:
        return main(argv)
    except PocketMoEError as e:
        print(error_line(e), file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(error_line(OSError(f"{where}{e.strerror or e}")), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def read_text_file(path: str, flag: str) -> str:
    """The text of a file a flag names (PocketMoEError, one line, where it cannot be read as UTF-8 text)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PocketMoEError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}; give a UTF-8 text file this user "
                             "can read.") from None


def int_list(text: str, flag: str, what: str = "value") -> list[int]:
    """A flag's comma-separated integers; one-sentence errors when it holds something else or nothing."""
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise PocketMoEError(f"{flag} must be comma-separated integers, got {text!r}.") from None
    if not values:
        raise PocketMoEError(f"{flag} is empty; give at least one {what}.")
    return values


def gib(nbytes: float, digits: int = 2) -> str:
    """Bytes as GiB text: `1.25 GiB`."""
    return f"{nbytes / GIB:.{digits}f} GiB"


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: `512 B`, `3.4 MiB`, `1.25 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


_NUMBER = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?%?( [A-Za-z/]+)?$")


def sizes(values: Sequence[float]) -> list[str]:
    """Byte counts in one shared unit (GiB, MiB or KiB, by the largest), so a column compares at a glance."""
    top = max((abs(v) for v in values), default=0)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= scale / 2:
            return [f"{v / scale:.2f} {unit}" for v in values]
    return [f"{int(v)} B" for v in values]


def _is_number(text: str) -> bool:
    """A number, optionally with a unit: `12`, `3.5%`, `4.00 GiB`, `1.2 GB/s`."""
    return bool(_NUMBER.match(text))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """An aligned text table; columns whose cells all look numeric are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    n = len(headers)
    if any(len(r) != n for r in cells):
        raise ValueError(f"every row needs {n} cells")
    widths = [max([len(headers[i])] + [len(r[i]) for r in cells]) for i in range(n)]
    right = [bool(cells) and all(_is_number(r[i]) or r[i] in ("", "-") for r in cells) for i in range(n)]

    def line(vals: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(vals, widths, right, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def cuda_memory_bytes() -> list[int]:
    """Total memory of each visible CUDA device ([] when torch sees none)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """The placement flags generate, bench and serve share (placement.run turns them into the plan)."""
    g = p.add_argument_group("placement")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the device: cuda (the GPUs), cpu (the CPU stands in for the device), auto (GPUs if any)")
    g.add_argument("--mode", default="auto", choices=["auto", "all-device", "heterogeneous", "cpu"],
                   help="all-device: every weight on the device; heterogeneous: routed experts in host memory "
                        "with a hot-expert cache on the device; cpu: no device; auto: all-device when it fits "
                        "(with --device cpu and no --gpu-memory-gib: cpu)")
    g.add_argument("--gpu-memory-gib", default=None, metavar="G[,G...]",
                   help="device memory to plan with, GiB: one size for every device or one per device "
                        "(default: what torch sees; the host's memory for --device cpu)")
    g.add_argument("--expert-policy", default="auto", choices=["auto", "cache", "stage", "cpu"],
                   help="missed experts: auto (the cost model picks staging or the CPU per expert), cache (stage "
                        "and keep hot ones), stage (stage every step, keep none), cpu (compute on the CPU)")
    g.add_argument("--expert-cache-slots", type=int, default=None, metavar="N",
                   help="hot-expert cache slots per MoE layer (default: the device memory the plan leaves free)")
    g.add_argument("--kv-dtype", default=DEFAULT_KV_DTYPE, choices=list(KV_DTYPE_BYTES),
                   help="what the KV cache stores: f32, or f16 / bf16 at half the memory (llama.cpp stores f16); "
                        f"default {DEFAULT_KV_DTYPE}")
    g.add_argument("--numa", default="auto", choices=["auto", "interleave", "off"],
                   help="the routed experts kept in host memory: interleave their pages over the NUMA memory nodes "
                        "(auto: when the host has two or more)")


def placement_from_args(args: argparse.Namespace) -> Any:
    """A placement.run.RunPlacement from the flags add_placement_args defined."""
    from pocketmoe.placement.run import RunPlacement

    sizes = None
    if args.gpu_memory_gib is not None:
        try:
            sizes = tuple(float(x) for x in str(args.gpu_memory_gib).split(",") if x.strip())
        except ValueError:
            raise PocketMoEError(f"--gpu-memory-gib {args.gpu_memory_gib!r} is not a number or a comma-separated "
                                 "list of numbers; give e.g. 4 or 22,22.") from None
    return RunPlacement(device=args.device, mode=args.mode, gpu_memory_gib=sizes, expert_policy=args.expert_policy,
                        expert_cache_slots=args.expert_cache_slots, numa=args.numa)
