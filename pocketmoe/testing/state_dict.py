"""Float weights (GGUF names, torch order) -> a real-convention GGUF, quantized by `pocketmoe.quant`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pocketmoe.errors import PocketMoEError
from pocketmoe.quant.quantize import QUANTIZABLE, quantize
from pocketmoe.testing.quant_mix import QuantMix, block_size, quant_mix, tensor_nbytes
from pocketmoe.testing.random_data import CHUNK_BYTES, F16, F32, I32, to_float_bytes
from pocketmoe.testing.synth import fixture_metadata, spec_for, tensor_plans
from pocketmoe.testing.writer import TensorPlan, write_gguf

FLOATS = (F32, F16, GGMLQuantizationType.BF16)


class StateDictError(PocketMoEError):
    """A state dict does not fit the architecture's spec, or a type cannot be produced from it."""


def _type_id(name: str, t: int | str) -> int:
    try:
        return int(GGMLQuantizationType[t.upper()] if isinstance(t, str) else GGMLQuantizationType(t))
    except (KeyError, ValueError):
        raise StateDictError(f"tensor {name}: {t!r} is not a GGML type name or id.") from None


def _check(spec: Any, state_dict: Mapping[str, torch.Tensor]) -> list[Any]:
    expected = spec.tensors(state_dict.keys())
    names = {t.name for t in expected}
    missing = [t.name for t in expected if not t.optional and t.name not in state_dict]
    unexpected = [n for n in state_dict if n not in names]
    wrong = [f"{t.name} {tuple(state_dict[t.name].shape)} (expected {t.shape})" for t in expected
             if t.name in state_dict and tuple(state_dict[t.name].shape) != t.shape]
    problems = [f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                if items]
    if problems:
        raise StateDictError(f"the state dict does not match the {spec.architecture} spec of this config "
                             f"({'; '.join(problems)}); fix the names/shapes or the config.")
    return [t for t in expected if t.name in state_dict]


def _file_type(types: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]]) -> QuantMix:
    """The pure mix of the type holding the most bytes (for general.file_type)."""
    weight = Counter({t: 0 for t in types.values()})
    for name, t in types.items():
        weight[t] += tensor_nbytes(t, shapes[name])
    try:
        return quant_mix(GGMLQuantizationType(weight.most_common(1)[0][0]).name)
    except PocketMoEError:
        return quant_mix("F32")


def _chunks(plan: TensorPlan, values: torch.Tensor) -> Iterator[np.ndarray]:
    if plan.ggml_type == I32:
        yield values.to(torch.int32).contiguous().numpy()
        return
    rows = values.detach().to(torch.float32).reshape(-1, plan.shape[-1])
    step = max(1, CHUNK_BYTES // (4 * plan.shape[-1]))
    for r in range(0, rows.shape[0], step):
        chunk = rows[r:r + step].contiguous().numpy()
        if plan.ggml_type in FLOATS:
            yield to_float_bytes(chunk, plan.ggml_type)
            continue
        yield quantize(chunk, plan.ggml_type)


def write_from_state_dict(arch: str, config: Any, state_dict: Mapping[str, torch.Tensor], out: Path,
                          types: Mapping[str, int | str] | str = "F32", shards: int = 1,
                          name: str | None = None) -> list[Path]:
    """Write `state_dict` (GGUF names, torch order, float) as a GGUF of `arch`/`config`.

    `types` is a --quant name ("F32", "Q8_0", "Q4_K_M", ...: llama.cpp's per-tensor choice) or a
    {name: GGML type id or name} map (tensors it leaves out are F32). Returns the written paths.
    """
    spec = spec_for(arch, config)
    specs = _check(spec, state_dict)
    if isinstance(types, str):
        mix = quant_mix(types)
        plans = tensor_plans(specs, mix, config.n_layer, spec.n_experts)
    else:
        chosen = {t.name: _type_id(t.name, types.get(t.name, F32)) for t in specs}
        bad = [n for n in types if n not in chosen]
        if bad:
            raise StateDictError(f"types name tensors not in the state dict: {', '.join(bad[:5])}.")
        plans = [TensorPlan(t.name, t.shape, chosen[t.name]) for t in specs]
        mix = _file_type(chosen, {t.name: t.shape for t in specs})
    for p, t in zip(plans, specs, strict=True):
        if (t.allowed_types and p.ggml_type not in t.allowed_types) or (
                t.float_only and not t.allowed_types and p.ggml_type not in FLOATS):
            raise StateDictError(f"tensor {p.name} must be stored as "
                                 f"{'/'.join(GGMLQuantizationType(x).name for x in t.allowed_types or FLOATS)}"
                                 f", not {p.type_name}.")
        if p.ggml_type not in QUANTIZABLE and p.ggml_type != I32:
            names = ", ".join(GGMLQuantizationType(t).name for t in QUANTIZABLE)
            raise StateDictError(f"tensor {p.name}: PocketMoE has no quantizer for {p.type_name}; give it "
                                 f"one of {names} in `types`.")
        if p.shape[-1] % block_size(p.ggml_type):
            raise StateDictError(f"tensor {p.name} rows of {p.shape[-1]} values do not fit "
                                 f"{p.type_name} blocks; choose another type for it.")
    meta = fixture_metadata(arch, config, mix, name or f"PocketMoE {arch} from state dict")
    return write_gguf(Path(out), arch, meta, plans, lambda p: _chunks(p, state_dict[p.name]), shards=shards)
