"""Malformed GGUF files (valid files written by gguf.GGUFWriter, then corrupted) raise GGUFError only.

Byte positions of the fields to corrupt come from gguf.GGUFReader, not from our own parser.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pocketmoe.gguf import GGUFError, open_bundle, open_gguf

HUGE = 2**62


def write_base(path: Path) -> None:
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_custom_alignment(32)
    w.add_uint32("test.aaa", 7)
    w.add_uint32("test.bbb", 8)
    w.add_bool("test.flag", True)
    w.add_string("test.text", "hello")
    w.add_array("test.words", ["alpha", "beta", "gamma", "delta"])
    w.add_key_value("test.bits", [True, False, True], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_key_value("test.nums", [1, 2, 3, 4], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    rng = np.random.default_rng(0)
    w.add_tensor("w.aa", rng.standard_normal((2, 32)).astype(np.float32))
    w.add_tensor("q.bb", gguf.quants.quantize(rng.standard_normal((3, 2, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("w.cc", rng.standard_normal(3).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class Layout:
    """Byte positions of the base file's fields, as gguf.GGUFReader sees them."""

    def __init__(self, path: Path) -> None:
        r = gguf.GGUFReader(path)
        base = r.data.ctypes.data

        def at(part: np.ndarray) -> int:
            return part.ctypes.data - base

        self.size = path.stat().st_size
        self.data_offset = int(r.data_offset)
        self.kv = {k: [at(p) for p in f.parts] for k, f in r.fields.items() if not k.startswith("GGUF.")}
        self.kv_sizes = {k: [p.nbytes for p in f.parts] for k, f in r.fields.items()}
        self.ti = {t.name: [at(p) for p in t.field.parts] for t in r.tensors}
        self.data = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in r.tensors}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Layout]:
    path = tmp_path_factory.mktemp("base") / "base.gguf"
    write_base(path)
    open_gguf(path).close()  # the base itself is valid
    return path.read_bytes(), Layout(path)


def put(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


def u16(v: int) -> bytes:
    return struct.pack("<H", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def expect_error(tmp_path: Path, data: bytes, pattern: str) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match=pattern) as e:
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"parsing a corrupt {len(data)}-byte file allocated {peak} bytes"
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    with pytest.raises(GGUFError, match=pattern):
        open_bundle(path)
    return message


# (id, mutation of (data, layout), pattern the message must match)
CASES: list[tuple[str, Callable[[bytes, Layout], bytes], str]] = [
    ("bad-magic", lambda d, L: put(d, 0, b"GGML"), "not a GGUF file.*magic"),
    ("version-1", lambda d, L: put(d, 4, u32(1)), "version 1 is not supported"),
    ("version-99", lambda d, L: put(d, 4, u32(99)), "unsupported GGUF version; expected 2 or 3, got 99"),
    ("version-0", lambda d, L: put(d, 4, u32(0)), "unsupported GGUF version"),
    ("big-endian", lambda d, L: put(d, 4, struct.pack(">I", 3)), "big-endian"),
    ("empty", lambda d, L: b"", "truncated.*0 bytes.*header"),
    ("short-header", lambda d, L: d[:20], "truncated.*20 bytes.*24-byte GGUF header"),
    ("huge-n-tensors", lambda d, L: put(d, 8, u64(HUGE)), f"claims {HUGE} tensors"),
    ("huge-n-kv", lambda d, L: put(d, 16, u64(HUGE)), f"{HUGE} metadata keys"),
    ("max-n-kv", lambda d, L: put(d, 16, u64(2**64 - 1)), "truncated or corrupt"),
    ("huge-key-length", lambda d, L: put(d, 24, u64(HUGE)), f"metadata key #0 \\({HUGE} bytes\\)"),
    ("huge-string", lambda d, L: put(d, L.kv["test.text"][3], u64(HUGE)), f"'test.text' \\({HUGE} bytes"),
    ("huge-array", lambda d, L: put(d, L.kv["test.words"][4], u64(HUGE)), f"claims {HUGE} string elements"),
    ("huge-array-num", lambda d, L: put(d, L.kv["test.nums"][4], u64(HUGE)), f"claims {HUGE} u32 elements"),
    ("huge-array-elem", lambda d, L: put(d, L.kv["test.words"][5], u64(HUGE)),
     f"'test.words'\\[0\\] \\({HUGE} bytes"),
    ("huge-tensor-name", lambda d, L: put(d, L.ti["w.aa"][0], u64(HUGE)), f"tensor #0 \\({HUGE} bytes"),
    ("unknown-value-type", lambda d, L: put(d, L.kv["test.aaa"][2], u32(13)), "unknown value type 13"),
    ("unknown-element-type", lambda d, L: put(d, L.kv["test.nums"][3], u32(77)), "unknown element type 77"),
    ("bad-utf8-key", lambda d, L: put(d, L.kv["test.bbb"][1], b"\xff"), "metadata key #.*not valid UTF-8"),
    ("bad-utf8-value", lambda d, L: put(d, L.kv["test.text"][4], b"\xc3("), "'test.text'.*not valid UTF-8"),
    ("bad-utf8-array", lambda d, L: put(d, L.kv["test.words"][8], b"\xe2\x82"), r"'test.words'\[1\].*UTF-8"),
    ("bad-utf8-tensor", lambda d, L: put(d, L.ti["q.bb"][1], b"\x80"), "name of tensor #1.*UTF-8"),
    ("bool-2", lambda d, L: put(d, L.kv["test.flag"][3], b"\x02"), "bool stored as 2; expected 0 or 1"),
    ("bool-array-3", lambda d, L: put(d, L.kv["test.bits"][6], b"\x03"), "'test.bits' holds a bool stored as 3"),
    ("duplicate-key", lambda d, L: put(d, L.kv["test.bbb"][1], b"test.aaa"), "'test.aaa' appears twice"),
    ("duplicate-tensor", lambda d, L: put(d, L.ti["w.cc"][1], b"w.aa"), "tensor 'w.aa' appears twice"),
    ("alignment-0", lambda d, L: put(d, L.kv["general.alignment"][3], u32(0)), "alignment is 0.*power of two"),
    ("alignment-48", lambda d, L: put(d, L.kv["general.alignment"][3], u32(48)), "alignment is 48"),
    ("alignment-type", lambda d, L: put(d, L.kv["general.alignment"][2], u32(5)), "alignment has type i32"),
    ("n-dims-0", lambda d, L: put(d, L.ti["w.aa"][2], u32(0)), "'w.aa' has n_dims 0; expected 1 to 4"),
    ("n-dims-5", lambda d, L: put(d, L.ti["w.aa"][2], u32(5)), "n_dims 5"),
    ("n-dims-huge", lambda d, L: put(d, L.ti["w.cc"][2], u32(2**31)), "n_dims 2147483648"),
    ("zero-dim", lambda d, L: put(d, L.ti["w.aa"][3], u64(0)), r"'w.aa' has dim ne\[0\] = 0"),
    ("negative-dim", lambda d, L: put(d, L.ti["q.bb"][3] + 16, u64(-3)), r"ne\[2\] = -3"),
    ("overflow-dims", lambda d, L: put(d, L.ti["q.bb"][3] + 8, u64(HUGE)), "more than 2\\*\\*63-1 elements"),
    ("huge-dim", lambda d, L: put(d, L.ti["w.cc"][3], u64(2**40)), "truncated|out of range"),
    ("unknown-type-5", lambda d, L: put(d, L.ti["w.aa"][4], u32(5)), "unknown GGML type id 5"),
    ("unknown-type-99", lambda d, L: put(d, L.ti["q.bb"][4], u32(99)), "unknown GGML type id 99"),
    ("not-block-multiple", lambda d, L: put(d, L.ti["q.bb"][3], u64(48)), "48 values.*block size 32"),
    ("offset-out-of-range", lambda d, L: put(d, L.ti["w.cc"][5], u64(2**40)), "offset 1099511627776, out of range"),
    ("offset-past-end", lambda d, L: put(d, L.ti["w.cc"][5], u64((L.size - L.data_offset + 31) // 32 * 32)),
     "out of range"),
    ("offset-misaligned", lambda d, L: put(d, L.ti["q.bb"][5], u64(L.data["q.bb"][0] - L.data_offset + 4)),
     "not aligned; expected a multiple of 32"),
    ("overlap", lambda d, L: put(d, L.ti["w.cc"][5], u64(L.data["q.bb"][0] - L.data_offset + 64)),
     "'w.cc' at byte .* overlaps tensor 'q.bb'"),
    ("same-offset", lambda d, L: put(d, L.ti["q.bb"][5], u64(0)), "overlaps"),
]


@pytest.mark.parametrize(("mutate", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corruption(tmp_path: Path, base: tuple[bytes, Layout], mutate: Callable, pattern: str) -> None:
    data, layout = base
    bad = mutate(data, layout)
    assert bad != data
    expect_error(tmp_path, bad, pattern)


def truncation_points(L: Layout) -> dict[str, int]:
    q_start, q_bytes = L.data["q.bb"]
    c_start, c_bytes = L.data["w.cc"]
    return {
        "magic": 2, "version": 6, "counts": 12, "first-key-length": 28, "first-key": L.kv["general.architecture"][1] + 3,
        "arch-value": L.kv["general.architecture"][4] + 2, "alignment": L.kv["general.alignment"][3] + 1,
        "string-array": L.kv["test.words"][7] + 1, "array-elem-len": L.kv["test.words"][9] + 3,
        "u32-array": L.kv["test.nums"][5] + 5, "tensor-name": L.ti["w.aa"][1] + 2, "dims": L.ti["q.bb"][3] + 12,
        "type": L.ti["w.cc"][4] + 1, "last-offset": L.ti["w.cc"][5] + 7, "end-of-infos": L.ti["w.cc"][5] + 8,
        "data-start": L.data_offset, "inside-q8": q_start + q_bytes // 2, "last-data-byte": c_start + c_bytes - 1,
    }


@pytest.mark.parametrize("point", [
    "magic", "version", "counts", "first-key-length", "first-key", "arch-value", "alignment", "string-array",
    "array-elem-len", "u32-array", "tensor-name", "dims", "type", "last-offset", "end-of-infos", "data-start",
    "inside-q8", "last-data-byte",
])
def test_truncated(tmp_path: Path, base: tuple[bytes, Layout], point: str) -> None:
    data, layout = base
    points = truncation_points(layout)
    assert sorted(points.values()) == list(points.values()), "points are in file order"
    expect_error(tmp_path, data[:points[point]], "truncated")


def test_truncated_at_every_third_byte_of_the_header(tmp_path: Path, base: tuple[bytes, Layout]) -> None:
    data, layout = base
    for at in range(0, layout.data_offset + 1, 3):
        expect_error(tmp_path, data[:at], "truncated")


def test_deep_array_nesting_is_refused(tmp_path: Path) -> None:
    key = b"nest"
    body = struct.pack("<Q", len(key)) + key + u32(9) + (u32(9) + u64(1)) * 2000 + u32(4) + u64(0)
    data = b"GGUF" + u32(3) + u64(0) + u64(1) + body
    expect_error(tmp_path, data, "nests arrays 17 deep; expected at most 16")


def test_nested_array_of_empty_arrays_with_huge_count(tmp_path: Path) -> None:
    key = b"nest"
    body = struct.pack("<Q", len(key)) + key + u32(9) + u32(9) + u64(HUGE)
    data = b"GGUF" + u32(3) + u64(0) + u64(1) + body + b"\0" * 64
    expect_error(tmp_path, data, f"claims {HUGE} array elements")


def test_fuzzed_files_parse_or_raise_gguf_error(tmp_path: Path, base: tuple[bytes, Layout]) -> None:
    data, layout = base
    rng = np.random.default_rng(1234)
    header_end = layout.data_offset + 16
    outcomes = {"ok": 0, "error": 0}
    path = tmp_path / "fuzz.gguf"
    for case in range(200):
        buf = bytearray(data)
        kind = case % 4
        if kind == 0:
            for pos in rng.integers(4, header_end, size=rng.integers(1, 6)):
                buf[pos] = int(rng.integers(0, 256))
        elif kind == 1:
            pos = int(rng.integers(4, header_end - 8))
            buf[pos:pos + 8] = u64(int(rng.integers(0, 2**63)) >> int(rng.integers(0, 63)))
        elif kind == 2:
            del buf[int(rng.integers(0, len(buf))):]
        else:  # flips inside tensor data only: the file stays valid and the views show the flips
            for pos in rng.integers(layout.data_offset, len(buf), size=8):
                buf[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(buf))
        try:
            f = open_gguf(path)
        except GGUFError as e:
            assert kind != 3 and str(e).startswith(f"{path}: "), str(e)
            outcomes["error"] += 1
            continue
        for name, info in f.tensors.items():
            assert f.raw(name).tobytes() == bytes(buf[info.offset:info.offset + info.nbytes])
        f.close()
        outcomes["ok"] += 1
    assert outcomes["ok"] >= 50 and outcomes["error"] >= 50, outcomes
