"""pocketmoe.gguf.GGUFFile against gguf.GGUFReader on files written by gguf.GGUFWriter."""

from __future__ import annotations

import struct
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from pocketmoe.gguf import GGUFError, open_bundle, open_gguf

SCALARS = [
    ("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16), ("t.i16", -30000, V.INT16),
    ("t.u32", 4_000_000_000, V.UINT32), ("t.i32", -2_000_000_000, V.INT32), ("t.f32", 0.1, V.FLOAT32),
    ("t.bool", True, V.BOOL), ("t.bool_f", False, V.BOOL), ("t.str", "héllo wörld ✓", V.STRING),
    ("t.u64", 2**63 + 5, V.UINT64), ("t.i64", -(2**62), V.INT64), ("t.f64", 1e300 / 3, V.FLOAT64),
]
ARRAYS = [
    ("a.u8", [1, 2, 255], V.UINT8), ("a.i8", [-1, 2], V.INT8), ("a.u16", [65535, 0], V.UINT16),
    ("a.i16", [-5, 7], V.INT16), ("a.u32", [1, 2, 3], V.UINT32), ("a.i32", [-1, 0, 1], V.INT32),
    ("a.f32", [0.5, -1.25, 3.0e-8], V.FLOAT32), ("a.bool", [True, False, True], V.BOOL),
    ("a.u64", [2**64 - 1, 3], V.UINT64), ("a.i64", [-(2**63), 2**63 - 1], V.INT64),
    ("a.f64", [1.5, -2e-300], V.FLOAT64), ("a.str", ["a", "", "ünï", "<|end|>"], V.STRING),
]
NESTED = {"n.ints": [[1, 2], [3, 4, 5], [6]], "n.strs": [["x", "yy"], ["zzz"]]}


def rng_f32(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def quantized(values: np.ndarray, qtype: T) -> np.ndarray:
    return gguf.quants.quantize(values, qtype)


def write_sample(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(path, "deepseek2")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, value, etype in ARRAYS:
        w.add_key_value(key, value, V.ARRAY, sub_type=etype)
    for key, value in NESTED.items():
        w.add_array(key, value)
    tensors = {
        "f32.weight": rng_f32((3, 5), 1),
        "f16.weight": rng_f32((4, 6), 2).astype(np.float16),
        "vec.bias": rng_f32((7,), 3),
        "q8.weight": quantized(rng_f32((5, 64), 4), T.Q8_0),
        "blk.0.ffn_up_exps.weight": quantized(rng_f32((4, 3, 64), 5), T.Q8_0),
        "i32.ids": np.arange(10, dtype=np.int32).reshape(2, 5),
    }
    for name, arr in tensors.items():
        raw_dtype = T.Q8_0 if arr.dtype == np.uint8 else None
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def flatten(value: object) -> list:
    if isinstance(value, list):
        return [x for v in value for x in flatten(v)]
    return [value]


@pytest.fixture(params=[None, 64], ids=["align32", "align64"])
def sample(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "sample.gguf"
    return path, write_sample(path, request.param)


def test_metadata_matches_gguf_reader(sample: tuple[Path, dict]) -> None:
    path, _ = sample
    ref = gguf.GGUFReader(path)
    f = open_gguf(path)
    assert f.version == 3 and f.alignment == ref.alignment and f.data_offset == ref.data_offset
    assert list(f.metadata) == list(ref.fields)[3:]  # the reader's first three are the header
    for key, field in list(ref.fields.items())[3:]:
        assert f.metadata_types[key] == field.types[0], key
        expected = field.contents()
        got = f.metadata[key]
        if field.types[0] == V.ARRAY:
            assert f.array_types[key] == field.types[1], key
            assert flatten(got) == expected, key  # GGUFReader flattens nested arrays
        else:
            assert key not in f.array_types
            assert got == expected and type(got) is type(expected), key
    for key, value, _ in SCALARS + ARRAYS:
        if isinstance(value, float):
            assert f.metadata[key] == pytest.approx(value, rel=1e-6)
    for key, value in NESTED.items():
        assert f.metadata[key] == value and f.array_types[key] == V.ARRAY
    assert f.metadata["general.architecture"] == "deepseek2"


def test_tensor_infos_and_bytes_match_gguf_reader(sample: tuple[Path, dict]) -> None:
    path, written = sample
    ref = gguf.GGUFReader(path)
    f = open_gguf(path)
    assert list(f.tensors) == [t.name for t in ref.tensors] == list(written)
    for rt in ref.tensors:
        info = f.tensors[rt.name]
        assert info.ne == tuple(int(x) for x in rt.shape)
        assert info.shape == tuple(reversed(info.ne))
        assert info.ggml_type == int(rt.tensor_type)
        assert info.offset == rt.data_offset and info.offset % f.alignment == 0
        assert info.nbytes == rt.n_bytes
        assert info.file_index == 0
        raw = f.raw(rt.name)
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        assert raw.shape == info.shape[:-1] + (info.row_bytes,)
        assert raw.tobytes() == rt.data.tobytes() == written[rt.name].tobytes()


def test_raw_is_zero_copy_and_raw_torch_shares_memory(sample: tuple[Path, dict]) -> None:
    path, _ = sample
    with open_bundle(path) as b:
        raw = b.raw("q8.weight")
        assert raw.base is not None and not raw.flags.owndata
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = b.raw_torch("q8.weight")
        assert t.dtype == torch.uint8 and tuple(t.shape) == raw.shape
        assert t.data_ptr() == raw.ctypes.data
        assert bytes(t.numpy().tobytes()) == raw.tobytes()


def test_expert_slices(sample: tuple[Path, dict]) -> None:
    path, written = sample
    name = "blk.0.ffn_up_exps.weight"
    stacked = written[name]  # uint8 [E, out, row_bytes]
    ref = gguf.GGUFReader(path)
    ref_data = next(t for t in ref.tensors if t.name == name).data
    with open_bundle(path) as b:
        info = b.tensors[name]
        out, row_bytes = info.shape[1], info.row_bytes
        whole = b.raw(name).reshape(-1)
        for e in range(info.shape[0]):
            got = b.expert_bytes(name, e)
            assert got.ndim == 1 and got.tobytes() == stacked[e].tobytes() == ref_data[e].tobytes()
            assert got.tobytes() == whole[e * out * row_bytes:(e + 1) * out * row_bytes].tobytes()
            assert b.expert_raw(name, e).shape == (out, row_bytes)
            assert np.shares_memory(got, whole)
        assert gguf.quants.dequantize(b.expert_raw(name, 2), T.Q8_0).shape == (3, 64)
        for bad in (-1, 4):
            with pytest.raises(GGUFError, match="expert"):
                b.expert_bytes(name, bad)
        with pytest.raises(GGUFError, match="3-D"):
            b.expert_bytes("q8.weight", 0)


def test_bundle_helpers(sample: tuple[Path, dict]) -> None:
    path, _ = sample
    ref = gguf.GGUFReader(path)
    by_type: dict[int, int] = {}
    for t in ref.tensors:
        by_type[int(t.tensor_type)] = by_type.get(int(t.tensor_type), 0) + int(t.n_bytes)
    with open_bundle(path) as b:
        assert b.architecture == "deepseek2" and len(b) == len(ref.tensors)
        assert "q8.weight" in b and "nope" not in b
        assert b.bytes_by_type() == by_type and b.total_bytes() == sum(by_type.values())
        assert b.paths == [path] and len(b.files) == 1
        with pytest.raises(GGUFError, match="nope"):
            b.raw("nope")
    b.close()


def test_closed_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_sample(path)
    f = open_gguf(path)
    kept = f.raw("f32.weight")
    f.close()
    assert kept.tobytes() == rng_f32((3, 5), 1).tobytes()
    with pytest.raises(GGUFError, match="closed"):
        f.raw("f32.weight")


def test_missing_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="directory"):
        open_gguf(tmp_path)


def hand_written_file(version: int) -> bytes:
    """A GGUF file written byte by byte from the format description (one KV, two F32 tensors)."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = b"GGUF" + struct.pack("<IQQ", version, 2, 2)
    out += s("general.architecture") + struct.pack("<I", 8) + s("llama")
    out += s("hand.ints") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", -1, 0, 7)
    out += s("a") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)
    out += s("b") + struct.pack("<IQIQ", 1, 3, 0, 32)
    out += b"\0" * (-len(out) % 32)
    out += np.arange(8, dtype=np.float32).tobytes()
    out += np.arange(3, dtype=np.float32).tobytes() + b"\0" * 20
    return out


@pytest.mark.parametrize("version", [2, 3])
def test_hand_written_v2_and_v3(tmp_path: Path, version: int) -> None:
    path = tmp_path / f"v{version}.gguf"
    path.write_bytes(hand_written_file(version))
    ref = gguf.GGUFReader(path)
    f = open_gguf(path)
    assert f.version == version
    assert f.metadata == {"general.architecture": "llama", "hand.ints": [-1, 0, 7]}
    assert f.metadata["hand.ints"] == ref.fields["hand.ints"].contents()
    assert f.array_types == {"hand.ints": V.INT32}
    for rt in ref.tensors:
        assert f.tensors[rt.name].offset == rt.data_offset
        assert f.raw(rt.name).tobytes() == rt.data.tobytes()
    assert f.tensors["a"].shape == (2, 4)


def test_large_vocab_parses_fast(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    tokens = [f"tok{i}_" + "x" * (i % 13) for i in range(100_000)]
    scores = [float(i) for i in range(100_000)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    start = time.process_time()  # CPU time, so that a busy machine does not fail the test
    f = open_gguf(path)
    elapsed = time.process_time() - start
    assert f.metadata["tokenizer.ggml.tokens"] == tokens
    assert f.metadata["tokenizer.ggml.scores"] == scores
    assert elapsed < 0.5, f"parsing a 100k-token vocab took {elapsed:.2f} s"
