"""Tensor parallelism on the CPU with gloo: `torchrun --nproc-per-node 2` against one process.

The 2-rank run (tests/parallel_run.py under torchrun) must give the same greedy tokens as this process and
logits within 1e-4 relative (F32 files: only the summation order of the all-reduces differs), for
deepseek2 (absorbed and legacy MLA, q LoRA, a Q8_0 file whose row-parallel splits fall on whole blocks),
MiniMax-M2 (GQA heads and the whole-projection q / k norms) and DeepSeek-V4 (heads and output groups,
hyper-connections, hash and biased routing, clamped experts, compressed entries past the window), on the
native and reference ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import parallel_run
import pytest
import torch

from pocketmoe import native
from pocketmoe.errors import PocketMoEError
from pocketmoe.layers.linear import QuantLinear
from pocketmoe.parallel import ColumnParallelLinear, HeadParallelLinear, Parallel, RowParallelLinear
from pocketmoe.parallel.model import shard_model
from pocketmoe.testing.synth import write_fixture

HERE = Path(__file__).parent
BACKENDS = ["reference"] + (["native"] if native.available() else [])


def torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tp")
    specs = {"ds2": ("deepseek2", "tiny", "F32"), "ds2-legacy": ("deepseek2", "tiny-legacy", "F32"),
             "ds2-qlora": ("deepseek2", "tiny-qlora", "F32"), "ds2-q8": ("deepseek2", "tiny", "Q8_0"),
             "mm2": ("minimax-m2", "tiny", "F32"), "ds4": ("deepseek4", "tiny", "F32")}
    return {k: str(write_fixture(a, p, q, d / f"{k}.gguf")[0]) for k, (a, p, q) in specs.items()}


def two_ranks(tmp_path: Path, backend: str, paths: list[str]) -> dict[str, dict[str, object]]:
    out = tmp_path / f"two-{backend}.pt"
    p = torchrun(str(HERE / "parallel_run.py"), str(out), backend, *paths)
    assert p.returncode == 0, p.stderr[-4000:]
    got = torch.load(out)
    assert got["world"] == 2
    return got["results"]


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_match_one_process(models: dict[str, str], tmp_path: Path, backend: str, one_thread: None) -> None:
    # Q8_0 on the reference ops only: the native ones quantize activations to int8 per block for it, and this
    # fixture has a token (the second sequence's last) where a 1e-7 relative change of the embedding alone
    # moves its logits by 7% in one process (an int8 rounding / routing near-tie): the reduce order's 1e-7
    # does the same
    keys = ["ds2", "ds2-legacy", "ds2-qlora", "mm2", "ds4"] + (["ds2-q8"] if backend == "reference" else [])
    two = two_ranks(tmp_path, backend, [models[k] for k in keys])
    for k in keys:
        one = parallel_run.outputs(parallel_run.runner_for(models[k], backend))
        got = two[models[k]]
        assert got["tokens"] == one["tokens"], k
        for name in ("prompt_logits", "prefill", "decode"):
            err = close(one[name], got[name])
            assert err < 1e-4, (k, name, err)


def fake_rank(rank: int, world: int) -> Parallel:
    """A Parallel that is never asked to communicate: sharding at load only."""
    return Parallel(None, rank, world, rank, "gloo", None, 1.0)


def test_unsplittable_dimension_names_numbers_and_largest_size(tmp_path: Path) -> None:
    from parallel_run import runner_for

    q4 = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "q4.gguf")[0]
    r = runner_for(str(q4), "reference")
    with pytest.raises(PocketMoEError, match=r"64 values in quant blocks of 256 .* cannot be split over 2 "
                                             r"tensor-parallel ranks; the largest valid .* is 1\."):
        shard_model(r.model, fake_rank(0, 2), 0)
    f32 = write_fixture("deepseek2", "tiny", "F32", tmp_path / "f32.gguf")[0]
    r = runner_for(str(f32), "reference")
    heads = r.model.blocks[0].attn.cfg.n_head
    with pytest.raises(PocketMoEError, match=rf"the {heads} MLA attention heads cannot be split over "
                                             rf"{heads + 1} .* largest valid .* is {heads}\."):
        shard_model(r.model, fake_rank(0, heads + 1), 0)


def test_each_rank_holds_only_its_own_bytes(models: dict[str, str]) -> None:
    """Column / head shards are views at their rows' offset in the memory map; row-parallel shards copy
    exactly their whole blocks of each row."""
    whole = parallel_run.runner_for(models["ds2-q8"], "reference").model
    for rank in range(2):
        part = shard_model(whole, fake_rank(rank, 2), 0)
        for b, pb in zip(whole.blocks, part.blocks, strict=True):
            a, pa = b.attn, pb.attn
            check_rows(a.wq, pa.wq, rank)
            check_heads(a.k_b, pa.k_b, rank)
            check_cols(a.wo, pa.wo, rank)
            assert pa.wkv_a is a.wkv_a  # the latent path is replicated
        check_rows(whole.head, part.head, rank)


def check_rows(w: QuantLinear, p: QuantLinear, rank: int) -> None:
    assert isinstance(p, ColumnParallelLinear)
    n = w.out_features // 2
    assert p.raw.data_ptr() == w.raw.data_ptr() + rank * n * w.raw.stride(-2)
    assert p.raw.untyped_storage().data_ptr() == w.raw.untyped_storage().data_ptr()
    assert torch.equal(p.raw, w.raw[rank * n:(rank + 1) * n])


def check_heads(w: QuantLinear, p: QuantLinear, rank: int) -> None:
    assert isinstance(p, HeadParallelLinear)
    n = w.shape[0] // 2
    assert p.raw.data_ptr() == w.raw.data_ptr() + rank * n * w.raw.stride(0)


def check_cols(w: QuantLinear, p: QuantLinear, rank: int) -> None:
    assert isinstance(p, RowParallelLinear)
    nb = w.raw.shape[-1] // 2
    assert torch.equal(p.raw, w.raw[..., rank * nb:(rank + 1) * nb])
    assert torch.equal(p.dense(), w.dense()[:, rank * w.in_features // 2:(rank + 1) * w.in_features // 2])


def test_bench_json_reports_one_allreduce_per_sublayer(models: dict[str, str]) -> None:
    """`bench --json` under torchrun: all-reduce time per token, and per decode token exactly one all-reduce
    per sublayer plus the embedding's (MiniMax-M2 adds its q / k norm statistics per layer)."""
    import json

    from pocketmoe.gguf import open_bundle

    for key, per_layer in (("ds2", 2), ("mm2", 3)):
        p = torchrun("-m", "pocketmoe.bench", "--model", models[key], "--json", "--prompt-tokens", "16",
                     "--gen-tokens", "4", "--threads", "1", "--bandwidth-mib", "8")
        assert p.returncode == 0, p.stderr[-3000:]
        tp = json.loads(p.stdout.strip().splitlines()[-1])["pocketmoe"]["tensor_parallel"]
        n_layer = int(open_bundle(models[key]).metadata[f"{open_bundle(models[key]).architecture}.block_count"])
        assert tp["world_size"] == 2 and tp["backend"] == "gloo"
        assert tp["allreduce_calls_per_token"]["decode"] == per_layer * n_layer + 1
        assert tp["allreduce_ms_per_token"]["decode"] > 0


def test_tensor_parallel_size_must_be_the_world_size(models: dict[str, str]) -> None:
    p = subprocess.run([sys.executable, "-m", "pocketmoe.serve", "--model", models["ds2"], "--tensor-parallel-size",
                        "2"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    assert p.returncode == 2
    assert "--tensor-parallel-size is 2 but the world size is 1" in p.stderr


def test_collectives_on_uneven_shares(tmp_path: Path) -> None:
    """Vocab slices of unequal width gather in rank order without their padding; the async all-reduce sums."""
    out = tmp_path / "coll.pt"
    p = torchrun(str(HERE / "parallel_collectives.py"), str(out), nproc=3)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out)
    for total in (7, 8, 4):
        want = torch.arange(total, dtype=torch.float32)[None, :] * (torch.arange(3)[:, None] + 1)
        assert torch.equal(got[total], want), total
    assert torch.equal(got["sum"], torch.full((4, 5), 6.0))
    assert got["calls"] == 1


def test_commbench_times_the_step_all_reduces_on_two_ranks() -> None:
    """The TP all-reduce cost (gpu_check's TP=1 step; here 2 gloo ranks): rank 0 reports one row per step size,
    the calls a step makes, and a paper projection that grows with the bytes a ring moves."""
    import json

    p = torchrun("-m", "pocketmoe.parallel.commbench", "--hidden", "256", "--layers", "3", "--tokens", "1,64",
                 "--iters", "3", "--json")
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]  # one report, from rank 0
    res = json.loads(line)
    assert (res["world_size"], res["backend"], res["calls_per_step"]) == (2, "gloo", 7)
    small, big = res["steps"]
    assert (small["bytes_per_call"], big["bytes_per_call"]) == (256 * 4, 64 * 256 * 4)
    assert all(s["measured_us_per_call"] > 0 for s in res["steps"])
    est = big["estimate_ms_per_step"]
    assert float(est["4"]) > float(est["2"]) > big["measured_us_per_call"] * 7 / 1e3


@pytest.mark.parametrize("arch", ["ds2", "ds4"])
def test_generate_under_torchrun_in_placement_modes(models: dict[str, str], arch: str) -> None:
    """`torchrun -m pocketmoe.generate` (rank 0 generates, rank 1 runs its steps) with the heterogeneous
    placement on the CPU device (rank-local experts through a 2-slot cache): the one-process greedy tokens."""
    import json

    flags = ["--model", models[arch], "--token-ids", "5,17,29,41,53,65,77,89", "--max-tokens", "6", "--ignore-eos",
             "--json", "--threads", "1", "--n-ctx", "64"]
    one = subprocess.run([sys.executable, "-m", "pocketmoe.generate", *flags], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr
    p = torchrun("-m", "pocketmoe.generate", *flags, "--device", "cpu", "--mode", "heterogeneous",
                 "--expert-cache-slots", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]  # rank 0's report only
    got = json.loads(line)
    assert got["mode"] == "heterogeneous" and got["experts"]["stats"]["hits"] + got["experts"]["stats"]["misses"] > 0
    assert got["token_ids"] == json.loads(one.stdout)["token_ids"]
