"""Barrier sweep: does a test fail when any one __syncthreads() of the engine's CUDA sources is removed?

Each mutant is a copy of the checkout's package and tests with one __syncthreads() of pocketmoe/ops/cuda/src
removed; the CUDA tests that run that source's kernels then run on it under the CPU shim, once per schedule
(the shim's thread order and shared-memory poison: pocketmoe.testing.cuda_shim ORDERS / POISONS). A mutant
that fails a test is caught; one that passes survives. A barrier whose line says `// defensive:` is one that
orders nothing where it stands today (each thread reads back only what it wrote, or another barrier or a
warp shuffle already orders the accesses): it must survive, and every other barrier must be caught, or the
tests miss a race a GPU could run into.

    python -m pocketmoe.testing.barrier_sweep                  every barrier (a few minutes on 2 cores)
    python -m pocketmoe.testing.barrier_sweep route.cu:54 ...  only these (source:line)

Prints one JSON object per mutant and schedule, then a summary; exits 1 when the outcome and the markers part.
Needs a source checkout (the tests/ folder beside the package).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pocketmoe.testing.cuda_shim import ORDER_ENV, POISON_ENV

ROOT = Path(__file__).resolve().parent.parent.parent
SRC = ROOT / "pocketmoe" / "ops" / "cuda" / "src"
BARRIER = "__syncthreads();"
DEFENSIVE = "// defensive:"

# The tests that run each source's kernels (pytest arguments; the shim's cases only).
_OPS = "tests/test_cuda_ops.py"
TESTS = {
    "common.cuh": [_OPS, "-k", "(norms or rms or attention or route or finalize) and not gpu"],
    "gemm.cuh": ["tests/test_cuda_matmul.py", "tests/test_cuda_backend.py", "-k",
                 "(moe_gemm or linear or batched or experts) and not mutated and not gpu"],
    "attention.cu": [_OPS, "-k", "attention and not gpu"],
    "route.cu": [_OPS, "-k", "route and not gpu"],
    "norm_rope.cu": [_OPS, "-k", "(norms or rms or rope) and not gpu"],
    "finalize.cu": [_OPS, "-k", "(norms or finalize) and not gpu"],
    "matmul.cu": ["tests/test_cuda_matmul.py", "-k", "not mutated"],
}
# (order, poison): the plain test run's schedule, and the unfair one (a warp runs ahead of the others to its
# next barrier) with the poison that fmaxf keeps
SCHEDULES = (("forward", "nan"), ("warps-reverse", "huge"))


@dataclass(frozen=True)
class Barrier:
    source: str
    offset: int
    line: int
    defensive: bool

    @property
    def name(self) -> str:
        return f"{self.source}:{self.line}"


def barriers() -> list[Barrier]:
    """Every __syncthreads() in src/."""
    out = []
    for path in sorted(SRC.iterdir()):
        text = path.read_text()
        for m in re.finditer(re.escape(BARRIER), text):
            end = text.find("\n", m.start())
            out.append(Barrier(path.name, m.start(), text.count("\n", 0, m.start()) + 1,
                               DEFENSIVE in text[m.start():end if end >= 0 else None]))
    return out


def run_mutant(b: Barrier, order: str, poison: str, cache: str) -> dict:
    """The tests of b's source on a copy of the checkout without b, under one schedule."""
    with tempfile.TemporaryDirectory(prefix="barrier-sweep-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "pocketmoe", work / "pocketmoe", symlinks=True)
        shutil.copytree(ROOT / "tests", work / "tests")
        src = work / "pocketmoe" / "ops" / "cuda" / "src" / b.source
        text = src.read_text()
        src.write_text(text[:b.offset] + "/* barrier removed */;" + text[b.offset + len(BARRIER):])
        env = dict(os.environ, PYTHONPATH=str(work), XDG_CACHE_HOME=cache, **{ORDER_ENV: order, POISON_ENV: poison})
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS[b.source]],
                           cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    lines = r.stdout.strip().splitlines()
    if r.returncode not in (0, 1):  # 1: a test failed; anything else (no tests, a collection error) is the sweep's
        raise RuntimeError(f"pytest on the mutant without {b.name} ended with exit code {r.returncode}, not a test "
                           f"result: {(r.stdout + r.stderr)[-2000:]}")
    return {"barrier": b.name, "defensive": b.defensive, "order": order, "poison": poison,
            "caught": r.returncode == 1, "pytest": lines[-1] if lines else r.stderr[-300:]}


def sweep(only: set[str] | None = None, jobs: int = 0, echo: bool = False) -> dict:
    """Every barrier (or those named source:line) under every schedule; the summary: which survived, and where
    that disagrees with the `// defensive:` markers."""
    if not (ROOT / "tests").is_dir():
        raise FileNotFoundError(f"the barrier sweep runs the checkout's tests, and {ROOT / 'tests'} is missing")
    sites = barriers()
    if missing := sorted({b.source for b in sites} - set(TESTS)):
        raise KeyError(f"no test selection for {', '.join(missing)}: add it to barrier_sweep.TESTS")
    if only:
        sites = [b for b in sites if b.name in only]
    cache = tempfile.mkdtemp(prefix="barrier-sweep-cache-")
    caught: dict[Barrier, bool] = {}
    try:
        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as ex:
            runs = [(b, o, p) for b in sites for o, p in SCHEDULES]
            for (b, _, _), res in zip(runs, ex.map(lambda j: run_mutant(*j, cache), runs), strict=True):
                if echo:
                    print(json.dumps(res), flush=True)
                caught[b] = caught.get(b, False) or res["caught"]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"barriers": len(caught), "caught": sum(caught.values()),
            "survivors": [b.name for b, c in caught.items() if not c],
            "untested": [b.name for b, c in caught.items() if not c and not b.defensive],
            "marked_defensive_but_caught": [b.name for b, c in caught.items() if c and b.defensive]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="source:line of the barriers to sweep (default: all)")
    ap.add_argument("--jobs", type=int, default=0, help="mutants run at once (default: the CPU count)")
    args = ap.parse_args(argv)
    summary = sweep(set(args.only) or None, args.jobs, echo=True)
    print(json.dumps(summary))
    return 1 if summary["untested"] or summary["marked_defensive_but_caught"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
