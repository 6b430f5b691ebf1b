"""Sharded bundles written by gguf.GGUFWriter(split_max_tensors=...) against gguf.GGUFReader per shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pocketmoe.gguf import GGUFBundle, GGUFError, open_bundle

N_TENSORS = 5


def tensor_values(i: int) -> np.ndarray:
    values = np.random.default_rng(i).standard_normal((4, 2, 32)).astype(np.float32)
    return gguf.quants.quantize(values, T.Q8_0) if i % 2 else values


def write_model(path: Path, arch: str = "minimax-m2", split_max_tensors: int = 0) -> list[Path]:
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_uint32("minimax-m2.block_count", 5)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for i in range(N_TENSORS):
        arr = tensor_values(i)
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", arr, raw_dtype=T.Q8_0 if arr.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(path.parent.glob(f"{path.stem}*.gguf"))


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    paths = write_model(tmp_path / "model.gguf", split_max_tensors=2)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return paths


def reader_offset(reader: gguf.GGUFReader, part: np.ndarray) -> int:
    return part.ctypes.data - reader.data.ctypes.data


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def patch_kv(path: Path, key: str, value: bytes) -> None:
    reader = gguf.GGUFReader(path)
    field = reader.fields[key]
    offset = reader_offset(reader, field.parts[-1])
    assert field.parts[-1].nbytes == len(value)
    del reader, field
    patch(path, offset, value)


def view(b: GGUFBundle) -> tuple:
    return b.paths, b.metadata, b.metadata_types, b.tensors, [b.raw(n).tobytes() for n in b.tensors]


def test_every_entry_point_gives_the_same_merged_view(shards: list[Path]) -> None:
    views = []
    for entry in [*shards, shards[0].parent]:
        with open_bundle(entry) as b:
            views.append(view(b))
    assert all(v == views[0] for v in views)


def test_merged_view_matches_each_shard(shards: list[Path]) -> None:
    with open_bundle(shards[1]) as b:
        assert b.paths == shards and len(b.files) == 3 and b.architecture == "minimax-m2"
        assert list(b.tensors) == [f"blk.{i}.ffn_up_exps.weight" for i in range(N_TENSORS)]
        ref0 = gguf.GGUFReader(shards[0])
        assert b.metadata == {k: f.contents() for k, f in list(ref0.fields.items())[3:]}
        assert b.metadata["split.count"] == 3 and b.metadata["split.tensors.count"] == N_TENSORS
        for i, path in enumerate(shards):
            ref = gguf.GGUFReader(path)
            assert ref.fields["split.no"].contents() == i
            for rt in ref.tensors:
                info = b.tensors[rt.name]
                assert (info.file_index, info.offset, info.nbytes) == (i, rt.data_offset, rt.n_bytes)
                assert info.ne == tuple(int(x) for x in rt.shape)
                assert b.raw(rt.name).tobytes() == rt.data.tobytes()
                stacked = tensor_values(int(rt.name.split(".")[1]))
                for e in range(info.shape[0]):
                    expected = stacked[e] if stacked.dtype == np.uint8 else stacked[e].view(np.uint8)
                    assert b.expert_bytes(rt.name, e).tobytes() == expected.tobytes()
        assert b.total_bytes() == sum(t.nbytes for t in b.tensors.values())
        assert set(b.bytes_by_type()) == {int(T.F32), int(T.Q8_0)}


def test_single_file_is_a_one_shard_bundle(tmp_path: Path) -> None:
    (path,) = write_model(tmp_path / "single.gguf")
    ref = gguf.GGUFReader(path)
    for entry in (path, tmp_path):
        with open_bundle(entry) as b:
            assert b.paths == [path] and "split.no" not in b.metadata
            assert [t.name for t in ref.tensors] == list(b.tensors)
            assert all(t.file_index == 0 for t in b.tensors.values())


def test_missing_shard(shards: list[Path]) -> None:
    shards[1].unlink()
    for entry in (shards[0], shards[2], shards[0].parent):
        with pytest.raises(GGUFError, match="missing shard.*model-00002-of-00003.gguf"):
            open_bundle(entry)


@pytest.mark.parametrize(
    ("shard", "key", "value", "expected"),
    [
        (1, "split.no", (5).to_bytes(2, "little"), "split.no is 5; expected 1"),
        (0, "split.no", (1).to_bytes(2, "little"), "split.no is 1; expected 0"),
        (2, "split.count", (4).to_bytes(2, "little"), "split.count is 4; expected 3"),
        (0, "split.tensors.count", (99).to_bytes(4, "little"), "split.tensors.count is 99; expected 5"),
        (2, "split.tensors.count", (4).to_bytes(4, "little"), "split.tensors.count is 4; expected 5"),
    ],
)
def test_wrong_split_keys(shards: list[Path], shard: int, key: str, value: bytes, expected: str) -> None:
    patch_kv(shards[shard], key, value)
    with pytest.raises(GGUFError, match=expected) as e:
        open_bundle(shards[0])
    assert str(e.value).startswith(str(shards[shard]))


def test_duplicate_tensor_across_shards(shards: list[Path]) -> None:
    reader = gguf.GGUFReader(shards[1])
    name_part = reader.tensors[0].field.parts[1]
    assert name_part.tobytes() == b"blk.2.ffn_up_exps.weight"
    offset = reader_offset(reader, name_part)
    del reader, name_part
    patch(shards[1], offset, b"blk.0.ffn_up_exps.weight")
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up_exps.weight' is also in model-00001-of-00003.gguf"):
        open_bundle(shards[2])


def test_single_file_with_split_keys_of_a_larger_bundle(shards: list[Path], tmp_path: Path) -> None:
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(shards[0], lone / "renamed.gguf")
    with pytest.raises(GGUFError, match="split.count is 3; expected 1"):
        open_bundle(lone / "renamed.gguf")


def test_shard_names_without_split_keys(tmp_path: Path) -> None:
    (one,) = write_model(tmp_path / "plain.gguf")
    single = one.rename(tmp_path / "plain-00001-of-00001.gguf")
    with open_bundle(single) as b:
        assert len(b.tensors) == N_TENSORS
    shutil.copy(single, tmp_path / "pair-00001-of-00002.gguf")
    shutil.copy(single, tmp_path / "pair-00002-of-00002.gguf")
    with pytest.raises(GGUFError, match="split.no is missing"):
        open_bundle(tmp_path / "pair-00002-of-00002.gguf")
    bad = tmp_path / "pair-00003-of-00002.gguf"
    shutil.copy(single, bad)
    with pytest.raises(GGUFError, match="shard 3 of 2"):
        open_bundle(bad)


def test_directories_with_zero_or_several_bundles(shards: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(GGUFError, match="holds 0 GGUF bundles.*no .gguf files"):
        open_bundle(empty)
    write_model(tmp_path / "other.gguf", split_max_tensors=3)
    with pytest.raises(GGUFError, match="holds 2 GGUF bundles") as e:
        open_bundle(tmp_path)
    assert "model-00001-of-00003.gguf and 2 more shards, other-00001-of-00002.gguf and 1 more" in str(e.value)
    (tmp_path / "stray.gguf").write_bytes(shards[0].read_bytes())
    with pytest.raises(GGUFError, match="holds 3 GGUF bundles.*stray.gguf"):
        open_bundle(tmp_path)


def test_missing_path_and_architecture(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        open_bundle(tmp_path / "nothing.gguf")
    (path,) = write_model(tmp_path / "noarch.gguf", arch="")
    with open_bundle(path) as b:
        assert "general.architecture" not in b.metadata
        with pytest.raises(GGUFError, match="general.architecture is missing"):
            _ = b.architecture


def test_prefetch_asks_for_a_tensor_and_checks_the_name(tmp_path) -> None:
    import mmap

    from pocketmoe.testing.synth import write_fixture

    (path,) = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "t.gguf", seed=1)
    with open_bundle(path) as b:
        assert b.prefetch("token_embd.weight") == hasattr(mmap, "MADV_WILLNEED")
        with pytest.raises(GGUFError, match="no tensor named 'nope'"):
            b.prefetch("nope")
