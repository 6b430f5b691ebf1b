"""`python -m pocketmoe.inspect_gguf`: JSON and text sections, exit codes, one-line user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pocketmoe import native
from pocketmoe.cli_util import EXIT_USER_ERROR, EXIT_VALIDATION, run_cli, sizes, table
from pocketmoe.inspect_gguf import main
from pocketmoe.quant.quantize import random_blocks
from pocketmoe.testing import plan_fixture, write_fixture
from pocketmoe.testing.random_data import tensor_chunks
from pocketmoe.testing.writer import write_gguf

ROOT = Path(__file__).resolve().parents[1]
PLACE = ["--num-gpus", "1", "--gpu-memory-gib", "2", "--host-memory-gib", "16", "--context-length", "256"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inspect")
    (good,) = write_fixture("deepseek2", "tiny", "Q4_K_M", d / "tiny.gguf")
    data = good.read_bytes()
    (d / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (d / "garbage.gguf").write_bytes(b"NOTGGUF" + bytes(100))
    plan = plan_fixture("deepseek2", "tiny", "Q4_K_M")
    kept = [t for t in plan.tensors if t.name != "blk.1.ffn_up_exps.weight"]
    write_gguf(d / "missing.gguf", "deepseek2", plan.metadata(), kept, lambda p: tensor_chunks(p, 0, 8))
    return {"good": good, "truncated": d / "truncated.gguf", "garbage": d / "garbage.gguf",
            "missing": d / "missing.gguf", "absent": d / "nope.gguf"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pocketmoe.inspect_gguf", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run_cli(main, list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err


def test_json_has_every_section_and_reader_byte_sums(files) -> None:
    r = cli("--gguf-path", str(files["good"]), "--json", *PLACE)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"architecture", "summary", "spec", "validation", "capability", "placement"}
    assert data["architecture"] == "deepseek2" and data["validation"]["ok"] is True
    reader = gguf.GGUFReader(files["good"])
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    total = sum(by_type.values())
    s = data["summary"]
    assert s["tensor_bytes"] == total and s["n_tensors"] == len(reader.tensors)
    assert {k: v["bytes"] for k, v in s["by_type"].items()} == by_type
    assert sum(v["bytes"] for v in s["by_role"].values()) == total
    routed = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    assert s["by_role"]["routed_expert"]["bytes"] == routed
    p = data["placement"]
    assert p["mode"] == "all-device" and sum(p["devices"][0]["weights_by_role"].values()) == total
    assert p["options"]["context_length"] == 256 and p["estimates"]["estimates"]


def test_text_summary_is_the_default(files, capsys) -> None:
    code, out, err = in_process(capsys, "--gguf-path", str(files["good"]))
    assert code == 0 and not err
    assert "Bytes by tensor type" in out and "Bytes by role" in out and "routed_expert" in out
    assert "Placement" not in out and "Validation" not in out
    for t in gguf.GGUFReader(files["good"]).tensors:
        assert t.tensor_type.name in out


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_summary_names_the_weight_types_without_kernels(files, tmp_path: Path, capsys, monkeypatch) -> None:
    """TQ1_0 has a native CPU kernel and a CUDA one; under a build whose kernels lacked it, the summary counts
    its matrices under each backend. A type with no kernel (Q8_K, activations only) is refused by both."""
    from pocketmoe.ops.cuda import matmul

    (tq1,) = write_fixture("deepseek2", "tiny", "TQ1_0", tmp_path / "tq1.gguf")
    mats = [t for t in gguf.GGUFReader(tq1).tensors if t.tensor_type.name == "TQ1_0" and len(t.shape) >= 2]
    want = {"TQ1_0": {"tensors": len(mats), "bytes": sum(int(t.n_bytes) for t in mats)}}
    assert mats
    code, out, _ = in_process(capsys, "--gguf-path", str(tq1), "--summary", "--json")
    kernels = json.loads(out)["summary"]["kernels"]
    assert code == 0 and kernels["native_cpu"]["missing"] == {} and kernels["cuda"]["missing"] == {}
    code, out, _ = in_process(capsys, "--gguf-path", str(tq1))
    assert "Native CPU kernels: every weight type has one." in out and "CUDA kernels: every weight type has one." in out
    without = native.supported_types() - {34}
    with monkeypatch.context() as m:   # a build whose CPU and CUDA kernels lack TQ1_0
        m.setattr(native, "supported_types", lambda: without)
        m.delitem(matmul.KERNELS, 34)
        code, out, _ = in_process(capsys, "--gguf-path", str(tq1), "--summary", "--json")
        kernels = json.loads(out)["summary"]["kernels"]
        assert kernels["native_cpu"]["missing"] == want and kernels["cuda"]["missing"] == want
        code, out, _ = in_process(capsys, "--gguf-path", str(tq1))
        assert f"Native CPU kernels: none for TQ1_0 ({len(mats)} tensors" in out
        assert f"CUDA kernels: none for TQ1_0 ({len(mats)} tensors" in out
    assert 34 in matmul.KERNELS
    q8k = random_blocks(15, (4, 256), np.random.default_rng(0))
    with pytest.raises(native.NativeKernelError, match="no native kernel"):
        native.gemm(q8k, 15, np.zeros((1, 256), np.float32))
    with pytest.raises(matmul.CudaMatmulError, match="no CUDA matmul kernel"):
        matmul.gemv(lambda *_: pytest.fail("launched"), torch.from_numpy(q8k), 15, 256, [])
    code, out, _ = in_process(capsys, "--gguf-path", str(files["good"]))
    assert "Native CPU kernels: every weight type has one." in out and "CUDA kernels: every weight type has one." in out


def test_text_sections_and_placement(files, capsys) -> None:
    code, out, _ = in_process(capsys, "--gguf-path", str(files["good"]), "--spec-summary", "--validate-spec",
                              "--capability-report", "--placement-report", "--num-gpus", "0",
                              "--host-memory-gib", "16")
    assert code == 0
    for heading in ("Spec: deepseek2", "Validation: ok", "Capability", "Placement: cpu", "Decode estimates",
                    "Assumptions"):
        assert heading in out
    assert "Bytes by tensor type" not in out


def test_validation_failure_exits_1(files, capsys) -> None:
    code, out, _ = in_process(capsys, "--gguf-path", str(files["missing"]), "--validate-spec")
    assert code == EXIT_VALIDATION and "blk.1.ffn_up_exps.weight" in out
    code, out, _ = in_process(capsys, "--gguf-path", str(files["missing"]), "--json")
    assert code == 0 and json.loads(out)["validation"]["ok"] is False


def test_architecture_override_reports_mismatch(files, capsys) -> None:
    code, out, err = in_process(capsys, "--gguf-path", str(files["good"]), "--architecture", "minimax-m2",
                                "--validate-spec", "--json")
    if code == EXIT_USER_ERROR:  # the other spec could not read these hyperparameters at all
        assert_one_line_error(err)
        return
    v = json.loads(out)["validation"]
    assert code == EXIT_VALIDATION and v["ok"] is False
    assert v["architecture_mismatch"] == {"file": "deepseek2", "requested": "minimax-m2"}


@pytest.mark.parametrize("which", ["absent", "truncated"])
def test_bad_files_are_one_line_errors(files, which) -> None:
    r = cli("--gguf-path", str(files[which]), "--json")
    assert r.returncode == EXIT_USER_ERROR and not r.stdout
    assert_one_line_error(r.stderr)
    assert str(files[which]) in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--architecture", "llama"], "deepseek2"),
    (["--placement-report", "--num-gpus", "1"], "--gpu-memory-gib"),
    (["--placement-report", "--num-gpus", "2", "--gpu-memory-gib", "4,4,4"], "3 sizes for 2 GPUs"),
    (["--placement-report", "--num-gpus", "1", "--gpu-memory-gib", "0.01", "--host-memory-gib", "16"],
     "--context-length"),
    (["--placement-report", "--num-gpus", "0", "--host-memory-gib", "0.001"], "CPU-only"),
])
def test_user_errors_exit_2(files, capsys, args, needle) -> None:
    code, out, err = in_process(capsys, "--gguf-path", str(files["good"]), *args)
    assert code == EXIT_USER_ERROR and not out
    assert_one_line_error(err)
    assert needle in err


def test_model_path_positional_or_flag(files, capsys) -> None:
    """The model may be named as gguf-dump and llama.cpp's tools take it, positionally, or with --gguf-path."""
    flagged = in_process(capsys, "--gguf-path", str(files["good"]), "--json")
    positional = in_process(capsys, str(files["good"]), "--json")
    both = in_process(capsys, str(files["good"]), "--gguf-path", str(files["good"]), "--json")
    assert flagged[0] == 0 and json.loads(flagged[1])["summary"]["n_tensors"] > 0
    assert positional == flagged and both == flagged
    for args, needle in (([], "no model given"), ([str(files["good"]), "--gguf-path", "other.gguf"], "two models")):
        r = cli(*args)
        assert r.returncode == EXIT_USER_ERROR and needle in r.stderr and "Traceback" not in r.stderr


def test_garbage_file_and_json_placement_refusal(files, capsys) -> None:
    code, _, err = in_process(capsys, "--gguf-path", str(files["garbage"]))
    assert code == EXIT_USER_ERROR
    assert_one_line_error(err)
    args = ["--num-gpus", "1", "--gpu-memory-gib", "0.01", "--host-memory-gib", "16"]
    code, out, err = in_process(capsys, "--gguf-path", str(files["good"]), "--json", *args)
    assert code == 0 and "error" in json.loads(out)["placement"] and not err
    code, out, err = in_process(capsys, "--gguf-path", str(files["good"]), "--json", "--placement-report", *args)
    assert code == EXIT_USER_ERROR and "error" in json.loads(out)["placement"]
    assert_one_line_error(err)


def test_table_and_sizes() -> None:
    text = table(["name", "bytes"], [["a", "1.00 GiB"], ["bbb", "12.50 GiB"]]).splitlines()
    assert len({len(line) for line in text}) == 1  # aligned
    assert text[2].endswith(" 1.00 GiB") and text[3].endswith("12.50 GiB")
    assert sizes([3 * 2**30, 2**20]) == ["3.00 GiB", "0.00 GiB"]
    assert sizes([3 * 2**20, 2**10]) == ["3.00 MiB", "0.00 MiB"]
