"""Synthetic fixtures, read back by the independent gguf.GGUFReader and checked against the specs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.specs import metadata_from_config, spec_from_bundle
from pocketmoe.testing.presets import PRESETS
from pocketmoe.testing.synth import main, plan_fixture, write_fixture

T = GGMLQuantizationType
TINY = [("deepseek2", "tiny"), ("deepseek2", "tiny-legacy"), ("deepseek2", "tiny-qlora"),
        ("minimax-m2", "tiny"), ("deepseek4", "tiny")]


def _fields(reader: GGUFReader) -> dict[str, tuple[object, int]]:
    """key -> (python value, GGUF value type) for every KV pair (not the GGUF.* header fields)."""
    return {k: (f.contents(), f.types[0]) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch,preset", TINY)
@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_tiny_fixture_reads_back(tmp_path: Path, arch: str, preset: str, quant: str) -> None:
    (path,) = write_fixture(arch, preset, quant, tmp_path / "m.gguf")
    plan = plan_fixture(arch, preset, quant)
    reader = GGUFReader(path)
    got = {t.name: t for t in reader.tensors}
    assert list(got) == [p.name for p in plan.tensors]
    for p in plan.tensors:
        t = got[p.name]
        assert tuple(int(d) for d in t.shape) == tuple(reversed(p.shape)), p.name  # GGUF order
        assert int(t.tensor_type) == p.ggml_type, p.name
        assert t.n_bytes == p.nbytes
    names = {t.name for t in plan.spec.tensors()}
    assert set(got) <= names
    fields = _fields(reader)
    for key, kv in metadata_from_config(arch, plan.config).items():
        assert key in fields, key
        value, vtype = fields[key]
        assert vtype == kv.type, key
        if isinstance(kv.value, float):
            assert value == pytest.approx(kv.value, rel=1e-6), key
        elif key not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            assert value == kv.value, key
    assert fields["general.architecture"] == (arch, GGUFValueType.STRING)
    assert fields["general.file_type"] == (int(plan.mix.file_type), GGUFValueType.UINT32)
    assert ("general.quantization_version" in fields) == (quant != "F32")
    assert fields["tokenizer.ggml.model"][0] == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"][0]) == plan.config.n_vocab
    bundle = open_bundle(path)
    report = spec_from_bundle(bundle).validate(bundle)
    assert report.ok, report.errors()


def test_tiny_weights_are_valid_and_sensible(tmp_path: Path) -> None:
    (path,) = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf")
    types = set()
    for t in GGUFReader(path).tensors:
        values = dequantize(np.asarray(t.data), t.tensor_type)
        types.add(t.tensor_type.name)
        assert np.isfinite(values).all(), t.name
        if t.name.endswith("_norm.weight"):
            assert abs(float(values.mean()) - 1.0) < 0.1, t.name
        elif t.tensor_type != T.F32 or values.ndim > 1:
            assert 0.0 < float(values.std()) < 1.0, t.name
    assert {"F32", "Q4_K", "Q5_K", "Q6_K", "Q5_0"} <= types


def test_shards_hold_the_same_tensors_as_one_file(tmp_path: Path) -> None:
    (single,) = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "one.gguf", seed=7)
    shards = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "three.gguf", shards=3, seed=7)
    assert [p.name for p in shards] == [f"three-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    ref = {t.name: np.asarray(t.data).tobytes() for t in GGUFReader(single).tensors}
    merged: dict[str, bytes] = {}
    counts = []
    for i, path in enumerate(shards):
        reader = GGUFReader(path)
        fields = _fields(reader)
        assert fields["split.no"] == (i, GGUFValueType.UINT16)
        assert fields["split.count"] == (3, GGUFValueType.UINT16)
        assert fields["split.tensors.count"] == (len(ref), GGUFValueType.INT32)
        if i == 0:
            assert "deepseek2.block_count" in fields and "tokenizer.ggml.tokens" in fields
        else:
            assert set(fields) == {"split.no", "split.count", "split.tensors.count"}
        counts.append(len(reader.tensors))
        for t in reader.tensors:
            assert t.name not in merged
            merged[t.name] = np.asarray(t.data).tobytes()
    assert max(counts) - min(counts) <= 1
    assert list(merged) == list(ref) and merged == ref
    bundle = open_bundle(shards[1])
    assert len(bundle.files) == 3
    assert spec_from_bundle(bundle).validate(bundle).ok


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = write_fixture("minimax-m2", "tiny", "Q4_K_M", tmp_path / "a.gguf", seed=3)[0]
    b = write_fixture("minimax-m2", "tiny", "Q4_K_M", tmp_path / "b.gguf", seed=3)[0]
    c = write_fixture("minimax-m2", "tiny", "Q4_K_M", tmp_path / "c.gguf", seed=4)[0]
    assert _digest(a) == _digest(b) != _digest(c)


@pytest.mark.parametrize("shards", [1, 2])
def test_sparse_fixture_is_the_same_file_with_zero_data(tmp_path: Path, shards: int) -> None:
    dense = write_fixture("deepseek4", "tiny", "Q4_K_M", tmp_path / "d.gguf", shards=shards, seed=1)
    sparse = write_fixture("deepseek4", "tiny", "Q4_K_M", tmp_path / "s.gguf", shards=shards, sparse=True)
    for d, s in zip(dense, sparse, strict=True):
        assert d.stat().st_size == s.stat().st_size
        rd, rs = GGUFReader(d), GGUFReader(s)
        assert [(t.name, t.tensor_type, t.data_offset) for t in rd.tensors] == \
               [(t.name, t.tensor_type, t.data_offset) for t in rs.tensors]
        assert all(not np.asarray(t.data).any() for t in rs.tensors)
        assert s.read_bytes()[:rs.tensors[0].data_offset] == d.read_bytes()[:rd.tensors[0].data_offset]


@pytest.mark.parametrize("arch", ["minimax-m2", "deepseek4"])
def test_sparse_full_preset_takes_no_disk_and_validates(tmp_path: Path, arch: str) -> None:
    plan = plan_fixture(arch, "full", "Q4_K_M")
    (path,) = write_fixture(arch, "full", "Q4_K_M", tmp_path / "full.gguf", sparse=True)
    assert path.stat().st_size >= plan.nbytes > 100e9
    assert path.stat().st_blocks * 512 < 64e6  # the header only; tensor data is holes
    bundle = open_bundle(path)
    assert spec_from_bundle(bundle).validate(bundle).ok


def test_full_deepseek2_q4_k_m_plan_matches_the_real_file_size() -> None:
    plan = plan_fixture("deepseek2", "full", "Q4_K_M")
    assert len(plan.tensors) == 404  # SPECS 1.3, current format
    total = 0
    for p in plan.tensors:  # independent byte count from gguf's block table
        block, size = GGML_QUANT_SIZES[T(p.ggml_type)]
        total += int(np.prod(p.shape)) // block * size
    assert total == plan.nbytes
    assert abs(total / 1e9 - 10.37) < 0.02  # ANCHORS.md: the real V2-Lite Q4_K_M mix is ~10.37 GB
    types = {p.name: T(p.ggml_type).name for p in plan.tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q8_0"  # Q6_K wanted, rows of 1408 fall back
    assert types["blk.3.ffn_down_exps.weight"] == "Q5_0"  # Q4_K wanted, falls back
    assert types["blk.1.ffn_gate_inp.weight"] == "F32" and types["blk.1.attn_k_b.weight"] == "Q5_0"


@pytest.mark.parametrize("preset, total, active", [("v3", 671e9, 37e9), ("kimi-k2", 1.0e12, 32e9)])
def test_v3_and_kimi_k2_presets_have_their_published_sizes(preset: str, total: float, active: float) -> None:
    """DeepSeek-V3 (671B parameters, 37B active a token) and Kimi-K2 (1T, 32B) as deepseek2 files: the counts the
    model cards give, from the tensors' shapes (no MTP layer: llama.cpp's converter leaves it out)."""
    plan = plan_fixture("deepseek2", preset, "Q4_K_M")
    c = plan.config
    params = sum(int(np.prod(p.shape)) for p in plan.tensors)
    routed = sum(int(np.prod(p.shape)) for p in plan.tensors if "_exps." in p.name)
    assert abs(params / total - 1) < 0.03
    assert 0 <= (params - routed + routed * c.n_expert_used // c.n_expert) / active - 1 < 0.03
    assert c.n_layer == 61 and c.n_dense_lead == (3 if preset == "v3" else 1)


def test_sparse_v3_file_is_placed_over_gpus_and_host(tmp_path: Path) -> None:
    """A V3-shaped IQ2_XXS file, sparse: four 22 GiB GPUs and 256 GiB of host memory hold it heterogeneously (hot
    experts cached, the rest computed on the CPU); a 4 GiB GPU cannot hold its attention, one clear error."""
    from pocketmoe.inspect_gguf import main as inspect

    (path,) = write_fixture("deepseek2", "v3", "IQ2_XXS", tmp_path / "v3.gguf", sparse=True)
    assert path.stat().st_blocks * 512 < 64e6
    out = tmp_path / "out.json"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert inspect([str(path), "--json", "--placement-report", "--host-memory-gib", "256", "--num-gpus", "4",
                        "--gpu-memory-gib", "22"]) == 0
    placement = json.loads(out.read_text())["placement"]
    assert placement["mode"] == "heterogeneous" and len(placement["devices"]) == 4
    assert all(d["cache_slots"] > 0 for d in placement["devices"])
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert inspect([str(path), "--json", "--placement-report", "--host-memory-gib", "256", "--num-gpus", "1",
                        "--gpu-memory-gib", "4"]) != 0
    assert "need" in json.loads(out.read_text())["placement"]["error"]


def test_bench_preset_is_the_452m_moe() -> None:
    plan = plan_fixture("deepseek2", "bench", "Q4_K_M")
    c = plan.config
    assert (c.n_embd, c.n_layer, c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_vocab) == (
        1024, 8, 32, 4, 512, 32000)
    assert abs(sum(int(np.prod(p.shape)) for p in plan.tensors) / 1e6 - 452) < 2


@pytest.mark.parametrize("arch", list(PRESETS))
def test_full_presets_plan_without_writing(arch: str) -> None:
    plan = plan_fixture(arch, "full", "MXFP4_MOE")
    assert plan.nbytes > 5e9
    assert any(p.type_name == "MXFP4" for p in plan.tensors)


def test_cli_writes_and_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert main(["--arch", "deepseek2", "--preset", "tiny", "--quant", "Q8_0", "--out", str(out),
                 "--quiet", "--seed", "1"]) == 0
    assert GGUFReader(out).fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    assert main(["--preset", "tiny", "--quant", "Q9_9", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown quant name 'Q9_9'")
    assert main(["--preset", "huge", "--out", str(out)]) == 2
    assert main(["--preset", "tiny", "--shards", "500", "--out", str(tmp_path / "x.gguf")]) == 2
    assert not (tmp_path / "x-00001-of-00500.gguf").exists()


def test_module_entry_point_lists_presets() -> None:
    proc = subprocess.run([sys.executable, "-m", "pocketmoe.testing.synth", "--list-presets"],
                          capture_output=True, text=True, timeout=300, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert "deepseek2" in proc.stdout and "bench" in proc.stdout and "deepseek4" in proc.stdout


def test_unknown_names_are_one_sentence_errors() -> None:
    for args in (("llama", "tiny", "F32"), ("deepseek2", "nope", "F32"), ("deepseek2", "tiny", "Q3")):
        with pytest.raises(PocketMoEError) as e:
            plan_fixture(*args)
        assert "\n" not in str(e.value)
