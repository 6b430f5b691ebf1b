"""llama.cpp (llama-cpp-python) as the parity reference: logits at every prompt position and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def llama_run(path: Path, prompt: list[int], gen: int, n_ctx: int) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits at every prompt position (F32 KV cache, flash attention off) and its greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2,
                          n_threads_batch=2, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False)
    try:
        llm.eval(prompt)
        logits = np.array(llm.scores[:len(prompt)], dtype=np.float32)
        out: list[int] = []
        while len(out) < gen:
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if len(out) < gen:
                llm.eval(out[-1:])
        return logits, out
    finally:
        llm.close()
