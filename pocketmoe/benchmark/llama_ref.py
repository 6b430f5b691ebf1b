"""llama.cpp's side (llama-cpp-python) at its best CPU settings, run in a child process.

Settings (SPECS.md section 5): flash attention on, logits of the last position only, F16 KV cache,
n_threads == n_threads_batch, mmap on, n_batch >= the prompt so prefill is one llama_decode call.
The child prints one JSON object; its memory numbers are its own, never mixed with ours.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pocketmoe.benchmark.timing import BenchSettings, engine_result, measure
from pocketmoe.errors import PocketMoEError
from pocketmoe.memstat import MemoryWatch

DEFAULT_UBATCH = 512  # llama.cpp's default physical batch


LLAMA_PYTHON_ENV = "POCKETMOE_LLAMA_PYTHON"  # an interpreter whose llama-cpp-python runs the reference
# "0": llama.cpp without its extra weight buffers (the CPU repack of Q4_K / Q4_0 / IQ4_NL into interleaved rows,
# AMX): the plain ggml CPU kernels, as `llama-cli --no-repack` runs; default "1", llama.cpp's default
EXTRA_BUFTS_ENV = "POCKETMOE_LLAMA_EXTRA_BUFTS"


def llama_python() -> str:
    """The interpreter the llama.cpp child runs in: $POCKETMOE_LLAMA_PYTHON (e.g. a venv holding a
    llama-cpp-python built with CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU), else this one."""
    return os.environ.get(LLAMA_PYTHON_ENV) or sys.executable


def require_llama_cpp() -> None:
    if os.environ.get(LLAMA_PYTHON_ENV):
        if not Path(os.environ[LLAMA_PYTHON_ENV]).is_file():
            raise PocketMoEError(f"${LLAMA_PYTHON_ENV} is {os.environ[LLAMA_PYTHON_ENV]!r}, which is not a file; "
                                 "point it at a python that has llama-cpp-python, or unset it.")
        return
    if importlib.util.find_spec("llama_cpp") is None:
        raise PocketMoEError("llama-cpp-python is not installed in this Python, so --llama-cpp cannot run; "
                             "install it (pip install llama-cpp-python==0.3.36) or drop --llama-cpp.")


class _LlamaStepper:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.n_vocab = int(llm.n_vocab())

    def _argmax(self) -> int:
        ptr = self.llm._ctx.get_logits_ith(-1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def prefill(self, ids: Sequence[int]) -> int:
        self.llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache
        self.llm.eval(list(ids))
        return self._argmax()

    def decode(self, token: int, pos: int) -> int:
        self.llm.eval([token])
        return self._argmax()


def extra_bufts() -> bool:
    raw = os.environ.get(EXTRA_BUFTS_ENV, "1")
    if raw not in ("0", "1"):
        raise PocketMoEError(f"${EXTRA_BUFTS_ENV} is {raw!r}; give 1 (llama.cpp's repacked weight buffers, its "
                             "default) or 0 (without them).")
    return raw == "1"


def load_llama(model: str | Path, s: BenchSettings) -> Any:
    import llama_cpp
    import llama_cpp.llama_cpp as low

    n_batch = min(max(s.prompt_tokens, DEFAULT_UBATCH), s.n_ctx)
    if not extra_bufts():  # the high-level Llama takes no such argument: its default model params do
        defaults = low.llama_model_default_params

        def no_extra_bufts() -> Any:
            p = defaults()
            p.use_extra_bufts = False
            return p

        low.llama_model_default_params = no_extra_bufts
    try:
        return llama_cpp.Llama(
            model_path=str(model), n_ctx=s.n_ctx, n_threads=s.threads, n_threads_batch=s.threads,
            n_batch=n_batch, n_ubatch=min(n_batch, DEFAULT_UBATCH), flash_attn=True, logits_all=False,
            use_mmap=True, n_gpu_layers=0, verbose=False)
    except ValueError as e:
        raise PocketMoEError(f"llama.cpp could not load {model}: {e}.") from None


def run_llama_cpp(model: str | Path, ids: Sequence[int], s: BenchSettings) -> tuple[dict[str, Any], list[int]]:
    """Time llama.cpp in this process: -> (result object with `version`, greedy tokens)."""
    import llama_cpp

    mem = MemoryWatch()
    t0 = time.perf_counter()
    llm = load_llama(model, s)
    load_s = time.perf_counter() - t0
    m = measure(_LlamaStepper(llm), ids, s.gen_tokens, s.repeats, mem.sample)
    result = engine_result("llama.cpp cpu", m, mem, load_s)
    result["version"] = f"llama-cpp-python {llama_cpp.__version__}"
    result["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    result["extra_bufts"] = extra_bufts()
    llm.close()
    return result, m.tokens


def run_llama_cpp_subprocess(model: str | Path, ids: Sequence[int], s: BenchSettings
                             ) -> tuple[dict[str, Any], list[int]]:
    """`run_llama_cpp` in a child `python -m pocketmoe.bench --engine llama-cpp`, JSON over stdout."""
    require_llama_cpp()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [llama_python(), "-m", "pocketmoe.bench", "--engine", "llama-cpp", "--model", str(model),
           "--token-ids", ",".join(map(str, ids)), "--gen-tokens", str(s.gen_tokens),
           "--threads", str(s.threads), "--repeats", str(s.repeats), "--n-ctx", str(s.n_ctx), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        errs = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        why = errs[-1].removeprefix("error: ") if errs else f"exit status {proc.returncode}"
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", why)
        if missing:  # the child needs llama-cpp-python, numpy and gguf, not torch
            raise PocketMoEError(f"the llama.cpp run in {cmd[0]} failed: it has no module {missing[1]!r}; "
                                 f"install it there ({cmd[0]} -m pip install numpy gguf llama-cpp-python==0.3.36).")
        raise PocketMoEError(f"the llama.cpp run failed: {why.rstrip('.')}.")
    out = json.loads(lines[-1])
    return out["llama_cpp"], [int(t) for t in out["tokens"]]
