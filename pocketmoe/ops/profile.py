"""Where a forward's time goes, by op: wall time of each outermost op call on one backend object.

`OpProfile(ops)` wraps the object's op methods in place (the layers hold that object), so every later
call is timed (and steps run op by op, not as a recorded program); nested calls (a reference op built from others) count once, in the outer op.
With a `sync` (torch.cuda.synchronize where ops launch GPU kernels, which return before they run), each outermost
op is bracketed by it, so its time is the kernels' and not their launches'.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

OPS = ("embed", "rms_norm", "add_rms_norm", "finalize", "linear", "linear_multi", "batched", "rope", "mla_sublayer",
       "ffn_sublayer", "moe_sublayer", "gqa_sublayer",
       "mla_attention", "gqa_attention", "route", "moe", "ffn", "hc_pre", "hc_post", "hc_head", "dsv4_attention",
       "dsv4_moe")


class OpProfile:
    def __init__(self, ops: Any, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = 0
        if hasattr(ops, "replay"):
            ops.replay = False  # a recorded step would run as one call: time it op by op instead
        for name in OPS:
            setattr(ops, name, self._timed(name, getattr(ops, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            if self._depth:
                return fn(*args, **kw)
            self._depth += 1
            if self._sync is not None:
                self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if self._sync is not None:
                    self._sync()
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
                self._depth -= 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{"seconds": {op: s}, "calls": {op: n}} since the last reset."""
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}
