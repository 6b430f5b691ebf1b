"""Synthetic real-convention GGUF fixtures for each architecture, any size, with valid random weights.

    python -m pocketmoe.testing.synth --arch deepseek2 --preset tiny --quant Q4_K_M --out tiny.gguf
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from pocketmoe.errors import PocketMoEError
from pocketmoe.specs import metadata_from_config, spec_class
from pocketmoe.testing.presets import PRESETS, preset_config
from pocketmoe.testing.quant_mix import QUANT_NAMES, QuantMix, choose_types, quant_mix
from pocketmoe.testing.random_data import tensor_chunks
from pocketmoe.testing.writer import FixtureError, TensorPlan, planned_bytes, write_gguf

QUANTIZATION_VERSION = 2


def spec_for(arch: str, config: Any) -> Any:
    """The ModelSpec of `arch` (from the spec registry) for exactly this config."""
    return spec_class(arch)(config)


def fixture_metadata(arch: str, config: Any, mix: QuantMix, name: str) -> dict[str, Any]:
    """All KV pairs of a fixture, in converter order: general.*, the architecture's keys, tokenizer."""
    from pocketmoe.testing.vocab import tokenizer_metadata

    meta: dict[str, Any] = {
        "general.architecture": (arch, GGUFValueType.STRING),
        "general.type": ("model", GGUFValueType.STRING),
        "general.name": (name, GGUFValueType.STRING),
    }
    meta |= {k: v for k, v in metadata_from_config(arch, config).items() if k != "general.architecture"}
    meta["general.file_type"] = (int(mix.file_type), GGUFValueType.UINT32)
    meta |= tokenizer_metadata(config.n_vocab)
    if mix.is_quantized:
        meta["general.quantization_version"] = (QUANTIZATION_VERSION, GGUFValueType.UINT32)
    return meta


def fixture_tensors(spec: Any) -> list[Any]:
    """The TensorSpecs a fixture holds: the required ones, an untied output.weight, and the router bias
    (exp_probs_b) where gating is sigmoid, as the converters write them."""
    sigmoid = getattr(spec.config, "gating_func", 0) == 2
    return [t for t in spec.tensors() if not t.optional or t.name == "output.weight"
            or (sigmoid and t.name.endswith(".exp_probs_b.bias"))]


def tensor_plans(specs: Sequence[Any], mix: QuantMix, n_layer: int, n_experts: int) -> list[TensorPlan]:
    """One plan per TensorSpec, typed by llama.cpp's choice for the mix (a spec's allowed_types win)."""
    chosen = choose_types(mix, [(t.name, t.shape, t.float_only or bool(t.allowed_types)) for t in specs],
                          n_layer, n_experts)
    return [TensorPlan(t.name, t.shape, int(t.allowed_types[0] if t.allowed_types else chosen[t.name]))
            for t in specs]


@dataclass(frozen=True)
class FixturePlan:
    arch: str
    preset: str
    mix: QuantMix
    config: Any
    spec: Any
    tensors: tuple[TensorPlan, ...]

    @property
    def nbytes(self) -> int:
        return planned_bytes(self.tensors)

    def metadata(self) -> dict[str, Any]:
        return fixture_metadata(self.arch, self.config, self.mix,
                                f"PocketMoE synthetic {self.arch} {self.preset} {self.mix.name}")


def plan_fixture(arch: str, preset: str, quant: str, **overrides: Any) -> FixturePlan:
    """What `write_fixture` would write (names, shapes, types, bytes), without writing anything."""
    config = preset_config(arch, preset, **overrides)
    mix = quant_mix(quant)
    spec = spec_for(arch, config)
    plans = tensor_plans(fixture_tensors(spec), mix, config.n_layer, spec.n_experts)
    return FixturePlan(arch, preset, mix, config, spec, tuple(plans))


def write_fixture(arch: str, preset: str, quant: str, out: Path, shards: int = 1, seed: int = 0,
                  progress: bool = False, sparse: bool = False, **overrides: Any) -> list[Path]:
    """Write a fixture GGUF (or `shards` shards); returns the written paths. `sparse` leaves every
    tensor's data a hole of zero bytes (full-size presets in no disk space, for inspect_gguf).

    Contents depend only on (arch, preset, quant, overrides, seed): each tensor has its own
    generator keyed by (seed, name), so sharding does not change a byte of tensor data.
    """
    if seed < 0:
        raise FixtureError(f"the seed must be a non-negative integer, got {seed}.")
    plan = plan_fixture(arch, preset, quant, **overrides)
    n_expert = plan.spec.n_experts
    return write_gguf(Path(out), arch, plan.metadata(), plan.tensors,
                      None if sparse else (lambda p: tensor_chunks(p, seed, n_expert)),
                      shards=shards, progress=progress)


def _list_presets() -> str:
    lines = []
    for arch, presets in PRESETS.items():
        for name in presets:
            plan = plan_fixture(arch, name, "Q4_K_M")
            n_params = sum(math.prod(t.shape) for t in plan.tensors)
            lines.append(f"{arch:12s} {name:12s} {n_params:>16,d} params  "
                         f"{len(plan.tensors):5d} tensors  {plan.nbytes / 1e9:9.3f} GB as Q4_K_M")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.testing.synth", description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=list(PRESETS), default="deepseek2")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--quant", default="Q4_K_M", help=f"one of {', '.join(QUANT_NAMES)}")
    p.add_argument("--out", type=Path, help="output path (PREFIX-0000k-of-0000N.gguf when sharded)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list-presets", action="store_true", help="list presets with sizes and exit")
    p.add_argument("--dry-run", action="store_true", help="print the plan (tensors, bytes) and exit")
    p.add_argument("--sparse", action="store_true",
                   help="leave tensor data as file holes (all-zero weights, no disk space): a full-size file "
                        "for inspect_gguf and placement reports, not for generation or benchmarks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.list_presets:
            print(_list_presets())
            return 0
        plan = plan_fixture(args.arch, args.preset, args.quant)
        if args.dry_run:
            for t in plan.tensors:
                print(f"{t.name:40s} {t.type_name:8s} {list(reversed(t.shape))} {t.nbytes}")
            print(f"{len(plan.tensors)} tensors, {plan.nbytes} bytes ({plan.nbytes / 1e9:.3f} GB) of tensor data")
            return 0
        if args.out is None:
            raise PocketMoEError("--out is required to write a fixture (or use --dry-run / --list-presets).")
        paths = write_fixture(args.arch, args.preset, args.quant, args.out, shards=args.shards,
                              seed=args.seed, progress=not args.quiet, sparse=args.sparse)
    except PocketMoEError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror or e}.", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}  {path.stat().st_size / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
