"""Thousands of randomly damaged model files: each is refused with a PocketMoEError or runs (load the
spec, tokenizer and runner, generate two tokens); never another exception, never a crash.

Runs `python -m pocketmoe.testing.mutate` in a child process (a crash in native code would show as
its exit status), seeded and bounded in time, per architecture that generates and per backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pocketmoe import native
from pocketmoe.testing.synth import write_fixture

ROOT = Path(__file__).resolve().parents[1]
CASES = [("deepseek2", "tiny", "Q4_K_M", "native", 1), ("deepseek2", "tiny-legacy", "Q8_0", "reference", 2),
         ("deepseek2", "tiny-qlora", "F32", "auto", 3), ("minimax-m2", "tiny", "Q4_K_M", "auto", 4)]


@pytest.mark.parametrize("arch,preset,quant,backend,seed", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_mutated_model_files_are_refused_or_run(tmp_path: Path, arch: str, preset: str, quant: str, backend: str,
                                                seed: int) -> None:
    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    (model,) = write_fixture(arch, preset, quant, tmp_path / "m.gguf", seed=seed)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "pocketmoe.testing.mutate", "--model", str(model),
                           "--count", "1200", "--seed", str(seed), "--seconds", "60", "--backend", backend],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["other_errors"] == [], out["other_errors"][:5]
    assert out["cases"] >= 300, out  # enough cases ran within the time bound
    assert out["refused"] > 0 and out["ran"] > 0, out  # the damage reaches both outcomes
