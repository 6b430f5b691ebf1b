"""Load and run randomly damaged model files: every one must be refused with a PocketMoEError or run.

    python -m pocketmoe.testing.mutate --model M.gguf [--count N] [--seed S] [--seconds T] [--backend B]

Each case flips a few bytes of a copy of the file (mostly in the header, metadata and tensor table,
where a flip changes what the file says; sometimes in tensor data), then opens it, builds the tokenizer
and the runner and generates two tokens. Prints one JSON line: counts of "refused" / "ran" and every
case that raised anything else, with its seed and the exception, so it can be replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pocketmoe.errors import PocketMoEError


def mutate(data: bytes, header_end: int, rng: np.random.Generator) -> bytes:
    """A copy of `data` with 1-4 bytes changed, or truncated (3%).

    Half the changes swap a printable byte of the header for another printable one (a key, a string or
    a token's text changes but every length stays right, so the damage gets past the reader); the rest
    are random bytes or bit flips, mostly in the header, sometimes in the tensor data.
    """
    buf = bytearray(data)
    if rng.random() < 0.03:
        return bytes(buf[:int(rng.integers(0, len(buf)))])
    header = np.frombuffer(data, dtype=np.uint8, count=header_end)
    printable = np.flatnonzero((header >= 0x20) & (header < 0x7F))
    for _ in range(int(rng.integers(1, 5))):
        r = rng.random()
        if r < 0.5 and len(printable):
            buf[int(rng.choice(printable))] = int(rng.integers(0x20, 0x7F))
            continue
        i = int(rng.integers(0, header_end if r < 0.9 else len(buf)))
        buf[i] = int(rng.integers(0, 256)) if r < 0.75 else buf[i] ^ (1 << int(rng.integers(0, 8)))
    return bytes(buf)


def run_case(path: Path, backend: str) -> None:
    """Load (spec, tokenizer, runner) and generate two tokens greedily."""
    from pocketmoe.engine.llm import LLM
    from pocketmoe.engine.sampler import SamplingParams

    llm = LLM(path, n_ctx=32, threads=1, backend=backend, max_num_seqs=1)
    try:
        llm.generate([llm.encode_prompt("Hello world")], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    finally:
        llm.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.testing.mutate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=120.0, help="stop early after this long")
    p.add_argument("--backend", default="auto")
    p.add_argument("--work", default=None, help="folder for the damaged copy (default: beside the model)")
    args = p.parse_args(argv)

    from pocketmoe.gguf import open_gguf

    src = Path(args.model)
    data = src.read_bytes()
    f = open_gguf(src)
    header_end = f.data_offset
    f.close()
    work = Path(args.work or src.parent) / f"mutated-{src.name}"
    counts = {"refused": 0, "ran": 0}
    bad: list[dict[str, object]] = []
    t0 = time.monotonic()
    n = 0
    for n in range(args.count):
        if time.monotonic() - t0 > args.seconds:
            break
        seed = args.seed * 1_000_003 + n
        work.write_bytes(mutate(data, header_end, np.random.default_rng(seed)))
        try:
            run_case(work, args.backend)
            counts["ran"] += 1
        except PocketMoEError:
            counts["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - anything else is what this hunts for
            bad.append({"seed": seed, "error": f"{type(exc).__name__}: {exc}",
                        "where": traceback.format_exc().splitlines()[-3].strip()})
    work.unlink(missing_ok=True)
    print(json.dumps({"cases": n + 1 if n else 0, "seconds": round(time.monotonic() - t0, 1), **counts,
                      "other_errors": bad}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
