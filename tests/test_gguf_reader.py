"""models/gguf_reader.py reads what the gguf package's own GGUFReader reads: every field
(types and decoded values) and every tensor (type, shape, offset, the bytes it views), on
files the gguf package writes with every value type, tensor type and byte order, and on the
embedded target's real GGUF; broken files are refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.gguf_reader import read_gguf


def assert_same(path):
    ours, ref = read_gguf(path), gguf.GGUFReader(str(path))
    want = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its pseudo-keys
    assert list(ours.fields) == list(want)
    for k, f in want.items():
        assert list(ours.fields[k].types) == [int(t) for t in f.types], k
        assert ours.fields[k].contents() == f.contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(n) for n in b.shape]
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def write(path, endian=gguf.GGUFEndian.LITTLE, alignment=None, fields=(), tensors=()):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


VT, T = gguf.GGUFValueType, gguf.GGMLQuantizationType
EVERY_FIELD = [
    ("a.u8", 200, VT.UINT8, None), ("a.i8", -5, VT.INT8, None), ("a.u16", 60000, VT.UINT16, None),
    ("a.i16", -300, VT.INT16, None), ("a.u32", 4_000_000_000, VT.UINT32, None),
    ("a.i32", -70000, VT.INT32, None), ("a.f32", 0.1, VT.FLOAT32, None),
    ("a.bool", True, VT.BOOL, None), ("a.str", "héllo ✓", VT.STRING, None),
    ("a.u64", 2**63 + 5, VT.UINT64, None), ("a.i64", -(2**40), VT.INT64, None),
    ("a.f64", 1e-300, VT.FLOAT64, None),
    ("a.ints", [1, 2, 3], VT.ARRAY, VT.INT32), ("a.floats", [0.5, -1.25], VT.ARRAY, VT.FLOAT32),
    ("a.bools", [True, False], VT.ARRAY, VT.BOOL), ("a.strs", ["", "x", "Ġthe"], VT.ARRAY, VT.STRING),
]  # fmt: skip


def every_tensor():
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 64)).astype(np.float32)
    return [
        ("w.f32", f, None),
        ("w.f16", f.astype(np.float16), None),
        ("w.q8", gguf.quants.quantize(f, T.Q8_0), T.Q8_0),
        ("w.bf16", gguf.quants.quantize(f, T.BF16), T.BF16),
        ("w.q4", gguf.quants.quantize(f, T.Q4_0), T.Q4_0),
        ("w.i64", np.arange(7, dtype=np.int64), T.I64),
        ("w.i32", np.arange(-3, 3, dtype=np.int32).reshape(2, 3), T.I32),
        ("w.scalar", np.array([2.5], dtype=np.float32), None),
    ]


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_the_gguf_package_reads_it(
    tmp_path, endian, alignment
):
    r = assert_same(write(tmp_path / "a.gguf", endian, alignment, EVERY_FIELD, every_tensor()))
    assert r.fields["a.strs"].contents() == ["", "x", "Ġthe"]
    assert r.fields["a.u64"].contents() == 2**63 + 5 and r.order == ("<" if endian == 0 else ">")
    t = {x.name: x for x in r.tensors}
    back = gguf.quants.dequantize(t["w.q8"].data, t["w.q8"].tensor_type)
    assert back.shape == (3, 64) and np.abs(back - every_tensor()[0][1]).max() < 0.05


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    strs=st.lists(st.text(max_size=12), min_size=1, max_size=40),
    ints=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40),
    n=st.integers(1, 5),
)
def test_random_string_and_integer_arrays_agree(tmp_path, strs, ints, n):
    p = write(
        tmp_path / "h.gguf",
        fields=[("s", strs, VT.ARRAY, VT.STRING), ("i", ints, VT.ARRAY, VT.INT32)],
        tensors=[("t", np.ones((n, 32), np.float32), None)],
    )
    r = assert_same(p)
    assert r.fields["s"].contents() == strs and r.fields["i"].contents() == ints


def test_the_embedded_targets_gguf_reads_as_the_gguf_package_reads_it():
    from models.target import smollm2_package_dir

    r = assert_same(smollm2_package_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert r.fields["general.architecture"].contents() == "llama"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_broken_files_are_refused(tmp_path):
    good = write(tmp_path / "g.gguf", fields=EVERY_FIELD, tensors=every_tensor()).read_bytes()
    for name, data, match in [
        ("magic", b"GGML" + good[4:], "magic"),
        ("version", good[:4] + (9).to_bytes(4, "little") + good[8:], "version 9"),
        ("header", good[:40], "ends early"),  # cut inside the fields
        ("data", good[: len(good) - 100], "past the end"),  # a tensor's bytes cut off
    ]:
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        with pytest.raises(ValueError, match=match):
            read_gguf(p)
