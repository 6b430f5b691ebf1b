"""The sections `inspect_gguf` prints: each is JSON-able data plus a text rendering of that data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pocketmoe.cli_util import size, sizes, table
from pocketmoe.placement import model_bytes
from pocketmoe.placement.report import ranges


def load_spec(bundle: Any, requested: str = "auto") -> Any:
    """The spec of the file's architecture, or of `requested`, reading the file's `{arch}.*` keys as its own."""
    from pocketmoe.specs import SpecError, spec_class, spec_from_bundle

    file_arch = bundle.architecture
    if requested in ("auto", file_arch):
        return spec_from_bundle(bundle)
    cls = spec_class(requested)
    prefix = f"{file_arch}."
    meta = {(f"{requested}.{k[len(prefix):]}" if k.startswith(prefix) else k): v
            for k, v in bundle.metadata.items()}
    meta["general.architecture"] = requested
    embd = bundle.tensors.get("token_embd.weight")
    hint = int(embd.shape[0]) if embd is not None and len(embd.shape) == 2 else None
    try:
        return cls.from_metadata(meta, hint)
    except SpecError as e:
        reason = " ".join(str(e).split()).split(";")[0].rstrip(".")
        raise SpecError(f"--architecture {requested} cannot read this {file_arch} file's hyperparameters "
                        f"({reason}); use --architecture auto.") from None


def _type_name(ggml_type: int) -> str:
    from pocketmoe.quant import QuantError, type_name

    try:
        return type_name(ggml_type)
    except QuantError:
        return f"type {ggml_type}"


def _counted(items: list[tuple[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for key, nbytes in items:
        entry = out.setdefault(key, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def kernel_coverage(bundle: Any) -> dict[str, Any]:
    """Per backend, the weight types of the file's matrices (2-D and up) that no kernel of it reads, with their
    tensor and byte counts: those run through the torch reference (dequantized per call) instead."""
    from pocketmoe import native
    from pocketmoe.ops.cuda.matmul import KERNELS

    weights = [t for t in bundle.tensors.values() if len(t.shape) >= 2]

    def missing(types: frozenset[int] | set[int]) -> dict[str, dict[str, int]]:
        return _counted([(_type_name(t.ggml_type), int(t.nbytes)) for t in weights if int(t.ggml_type) not in types])

    cpu = {"available": native.available(), "missing": missing(native.supported_types())} if native.available() \
        else {"available": False, "reason": native.unavailable_reason(), "missing": {}}
    return {"native_cpu": cpu, "cuda": {"missing": missing(set(KERNELS))}}


def summary(bundle: Any, spec: Any) -> dict[str, Any]:
    """Files, tensor bytes by GGML type and by role, and the MoE facts that set decode speed."""
    mb = model_bytes(spec, bundle.tensors)
    meta = bundle.metadata
    return {
        "paths": [str(p) for p in bundle.paths],
        "shards": len(bundle.paths),
        "file_bytes": sum(p.stat().st_size for p in bundle.paths),
        "architecture": bundle.architecture,
        "name": meta.get("general.name"),
        "file_type": meta.get("general.file_type"),
        "n_metadata": len(meta),
        "n_tensors": len(bundle.tensors),
        "tensor_bytes": mb.total,
        "by_type": _counted([(_type_name(t.ggml_type), int(t.nbytes)) for t in bundle.tensors.values()]),
        "by_role": _counted([(t.role, t.nbytes) for t in mb.tensors]),
        "kernels": kernel_coverage(bundle),
        "moe": {
            "n_experts": mb.n_experts,
            "n_experts_used": mb.n_experts_used,
            "moe_layers": mb.moe_layers,
            "expert_bytes_max": mb.max_expert_bytes,
            "routed_bytes": mb.routed,
            "non_expert_bytes": mb.non_expert,
            "routed_bytes_per_token": mb.routed_bytes_per_token(),
            "non_expert_bytes_per_token": mb.non_expert_read_per_token(),
        },
    }


def _share_table(title: str, key: str, groups: Mapping[str, Mapping[str, int]], total: int) -> str:
    text = sizes([v["bytes"] for v in groups.values()])
    rows = [[k, v["tensors"], t, f"{100 * v['bytes'] / max(total, 1):.1f}%"]
            for (k, v), t in zip(groups.items(), text, strict=True)]
    return f"{title}\n" + table([key, "tensors", "bytes", "share"], rows)


def summary_text(s: Mapping[str, Any]) -> str:
    moe = s["moe"]
    head = [
        f"File: {', '.join(s['paths'])} ({s['shards']} shard(s), {size(s['file_bytes'])})",
        f"Architecture: {s['architecture']}; name: {s['name'] or '-'}; file type: {s['file_type']}",
        f"Tensors: {s['n_tensors']} holding {size(s['tensor_bytes'])}; metadata keys: {s['n_metadata']}",
        f"MoE: {len(moe['moe_layers'])} MoE layers ({ranges(moe['moe_layers'])}), {moe['n_experts']} experts, "
        f"top-{moe['n_experts_used']}; one expert up to {size(moe['expert_bytes_max'])}; routed experts "
        f"{size(moe['routed_bytes'])}, the rest {size(moe['non_expert_bytes'])}",
        f"Bytes read per decode token: routed {moe['routed_bytes_per_token'] / 1e9:.3f} GB + non-expert "
        f"{moe['non_expert_bytes_per_token'] / 1e9:.3f} GB",
    ]
    return "\n".join([
        "\n".join(head),
        _share_table("Bytes by tensor type", "type", s["by_type"], s["tensor_bytes"]),
        _share_table("Bytes by role", "role", s["by_role"], s["tensor_bytes"]),
        kernels_text(s["kernels"]),
    ])


def kernels_text(k: Mapping[str, Any]) -> str:
    """One line per backend: every weight type has a kernel there, or which do not and what that costs."""

    def listed(missing: Mapping[str, Mapping[str, int]]) -> str:
        return ", ".join(f"{name} ({v['tensors']} tensors, {size(v['bytes'])})" for name, v in missing.items())

    cpu, cuda = k["native_cpu"], k["cuda"]
    if not cpu["available"]:
        lines = [f"Native CPU kernels: not built here ({cpu['reason']}); every weight would run through the torch "
                 f"reference."]
    elif cpu["missing"]:
        lines = [f"Native CPU kernels: none for {listed(cpu['missing'])}; those weights run through the torch "
                 f"reference (dequantized per call: slower, and a decode step runs op by op)."]
    else:
        lines = ["Native CPU kernels: every weight type has one."]
    if cuda["missing"]:
        lines.append(f"CUDA kernels: none for {listed(cuda['missing'])}; on a GPU those weights are computed on "
                     f"the host (a copy each way per call).")
    else:
        lines.append("CUDA kernels: every weight type has one.")
    return "Kernels\n" + "\n".join("  " + line for line in lines)


def _flat(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, Mapping):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def spec_text(d: Mapping[str, Any]) -> str:
    skip = {"config", "architecture"}
    counts = [[k, ranges(v) if k == "moe_layers" else (f"{v:,}" if isinstance(v, int) else v)]
              for k, v in d.items() if k not in skip]
    config = [[k, v] for k, v in _flat(d.get("config", {}))]
    return "\n".join([f"Spec: {d.get('architecture')}", table(["item", "value"], counts),
                      "Config", table(["field", "value"], config)])


def validation(spec: Any, bundle: Any, file_arch: str) -> dict[str, Any]:
    out = spec.validate(bundle).to_json()
    if spec.architecture != file_arch:
        out["ok"] = False
        out["architecture_mismatch"] = {"file": file_arch, "requested": spec.architecture}
        out["errors"] = [f"the file's general.architecture is {file_arch!r} but it was checked as "
                         f"{spec.architecture!r}; use --architecture auto or a {spec.architecture} file.",
                         *out.get("errors", [])]
    return out


def validation_text(v: Mapping[str, Any]) -> str:
    if v["ok"]:
        return f"Validation: ok (every tensor matches the {v.get('architecture') or ''} spec)"
    errors = v.get("errors", [])
    return f"Validation: {len(errors)} problem(s)\n" + "\n".join(f"  - {e}" for e in errors)


def capability_text(c: Mapping[str, Any]) -> str:
    return "Capability\n" + table(["item", "value"], [[k, v] for k, v in _flat(c)])
