"""NUMA placement of the host experts (pocketmoe.numa): the node list as sysfs writes it, the thread policy set
and put back through the real syscalls (read back with get_mempolicy), the expert pages read in under it (their
node read back page by page), what each --numa policy does, and the runner's report of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketmoe import numa
from pocketmoe.numa import (
    MPOL_DEFAULT,
    MPOL_INTERLEAVE,
    NumaError,
    memory_nodes,
    parse_node_list,
    place_experts,
)

ROOT = Path(__file__).resolve().parents[1]


def _syscalls_work() -> str | None:
    try:
        numa.SYSCALLS.policy()
    except OSError as e:
        return f"get_mempolicy is refused here: {e}"
    return None


NO_SYSCALLS = _syscalls_work()


def test_node_lists_as_sysfs_writes_them(tmp_path) -> None:
    assert parse_node_list("0\n") == [0]
    assert parse_node_list("0-3") == [0, 1, 2, 3]
    assert parse_node_list("0,2-3,7") == [0, 2, 3, 7]
    with pytest.raises(NumaError, match="cannot read the node list 'x-1'"):
        parse_node_list("x-1")
    (tmp_path / "online").write_text("0-1\n")
    assert memory_nodes(tmp_path) == [0, 1]  # no has_memory: the online nodes
    (tmp_path / "has_memory").write_text("1\n")
    assert memory_nodes(tmp_path) == [1]  # node 0 without memory (a CPU-only node) is left out
    assert memory_nodes(tmp_path / "missing") == [0]


@pytest.mark.skipif(NO_SYSCALLS is not None, reason=str(NO_SYSCALLS))
def test_interleaved_sets_the_thread_policy_and_puts_it_back() -> None:
    nodes = memory_nodes()
    assert numa.SYSCALLS.policy()[0] == MPOL_DEFAULT
    with numa.interleaved(nodes):
        assert numa.SYSCALLS.policy() == (MPOL_INTERLEAVE, nodes)
    assert numa.SYSCALLS.policy()[0] == MPOL_DEFAULT
    with pytest.raises(RuntimeError), numa.interleaved(nodes):
        raise RuntimeError("the block fails")
    assert numa.SYSCALLS.policy()[0] == MPOL_DEFAULT  # put back on the way out of a failure too


@pytest.mark.skipif(NO_SYSCALLS is not None, reason=str(NO_SYSCALLS))
def test_place_experts_reads_every_page_in_and_reports_their_nodes(tmp_path) -> None:
    """A memory-mapped file, as the experts are: interleave reads its pages in under the policy and reports the node
    of a strided sample, read back page by page; auto on one node and off place nothing."""
    path = tmp_path / "experts.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    arrays = [mm[: 1 << 20], mm[(1 << 20) + 100:]]
    nodes = memory_nodes()
    pages = sum(-(-a.nbytes // numa.PAGE) for a in arrays)
    rep = place_experts(arrays, "interleave", nodes)
    assert rep.placed and rep.bytes == sum(a.nbytes for a in arrays)
    sampled = rep.sampled_pages_by_node
    assert set(sampled) <= set(nodes) and 0 < sum(sampled.values()) <= pages
    js = rep.to_json()
    assert js["policy"] == "interleave" and js["placed"] is True and sum(js["sampled_pages_by_node"].values()) > 0
    assert numa.SYSCALLS.policy()[0] == MPOL_DEFAULT
    one = place_experts(arrays, "auto", [0])
    assert not one.placed and one.reason == "one memory node: nothing to spread"
    assert not place_experts(arrays, "off", [0, 1]).placed
    with pytest.raises(NumaError, match="--numa 'spread' is not one of auto, interleave, off"):
        place_experts(arrays, "spread")


def test_a_refused_policy_is_one_clear_error_for_interleave_and_a_note_for_auto(monkeypatch) -> None:
    def refuse(mode, nodes):  # noqa: ANN001, ANN202
        raise OSError(1, "set_mempolicy: Operation not permitted")

    monkeypatch.setattr(numa.SYSCALLS, "set_policy", refuse)
    a = [np.zeros(8192, dtype=np.uint8)]
    with pytest.raises(NumaError, match=r"--numa interleave could not set the memory policy \(set_mempolicy: "
                                        r"Operation not permitted\); run without it or with --numa off\."):
        place_experts(a, "interleave", [0, 1])
    rep = place_experts(a, "auto", [0, 1])
    assert not rep.placed and rep.reason.startswith("not placed: ")


@pytest.mark.skipif(NO_SYSCALLS is not None, reason=str(NO_SYSCALLS))
def test_generate_numa_interleave_reports_the_placement_and_keeps_the_tokens(tmp_path) -> None:
    from pocketmoe.testing.synth import write_fixture

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=3)[0]

    def gen(*flags: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "pocketmoe.generate", "--model", str(model), "--token-ids",
                            "5,17,29,41", "--max-tokens", "4", "--ignore-eos", "--json", "--n-ctx", "32", "--threads",
                            "1", "--device", "cpu", *flags], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    off, inter = gen("--numa", "off"), gen("--numa", "interleave", "--mode", "heterogeneous")
    assert inter["token_ids"] == off["token_ids"]
    assert off["experts"]["numa"]["placed"] is False
    got = inter["experts"]["numa"]
    assert got["placed"] is True and got["bytes"] > 0 and got["nodes"] == memory_nodes()
