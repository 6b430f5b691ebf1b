"""The result of checking a bundle's tensors against a ModelSpec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LISTED = 8


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


@dataclass
class ValidationReport:
    """Findings of `ModelSpec.validate`. `ignored` lists tensors the engine knowingly skips (MTP)."""

    ok: bool
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    unsupported_type: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    architecture: str = ""

    @staticmethod
    def build(architecture: str, missing: list[str], unexpected: list[str],
              wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
              unsupported_type: list[tuple[str, str]], ignored: list[str]) -> ValidationReport:
        ok = not (missing or unexpected or wrong_shape or unsupported_type)
        return ValidationReport(ok, missing, unexpected, wrong_shape, unsupported_type, ignored, architecture)

    def errors(self, limit: int = MAX_LISTED) -> list[str]:
        """One sentence per problem, at most `limit` per kind, then one "and N more" sentence."""
        arch = self.architecture or "this architecture"
        out: list[str] = []

        def add(items: list[Any], sentence: Any, kind: str) -> None:
            out.extend(sentence(x) for x in items[:limit])
            if len(items) > limit:
                out.append(f"... and {len(items) - limit} more {kind} tensors.")

        add(self.missing, lambda n: f"tensor {n!r} is required by the {arch} spec but is missing from "
                                    f"the file; re-convert or re-download the model.", "missing")
        add(self.wrong_shape, lambda x: f"tensor {x[0]!r} has shape {_shape(x[2])} but the {arch} spec "
                                        f"expects {_shape(x[1])} from the file's metadata; the metadata "
                                        f"and weights disagree, re-convert the model.", "wrong-shape")
        add(self.unsupported_type, lambda x: f"tensor {x[0]!r} is stored as {x[1]}, which PocketMoE "
                                             f"cannot run for this tensor; re-quantize it to a supported "
                                             f"type such as Q8_0 or Q4_K (F32 for norms and routers).",
            "unsupported-type")
        add(self.unexpected, lambda n: f"tensor {n!r} is not part of the {arch} spec; the file may be "
                                       f"for a different model variant.", "unexpected")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "ok": self.ok,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "wrong_shape": [{"name": n, "expected": list(e), "actual": list(a)} for n, e, a in self.wrong_shape],
            "unsupported_type": [{"name": n, "type": t} for n, t in self.unsupported_type],
            "ignored": list(self.ignored),
            "errors": self.errors(),
        }
