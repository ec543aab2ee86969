"""Reading a GGUF file: its key-value fields, decoded, and its tensors, mapped from the file.

The ``gguf`` package's ``GGUFReader`` builds a NumPy view for every element of every array
field before it returns: seconds on a target GGUF with a 49,152-token vocabulary and its
merges, paid each time an engine's evaluation asks a GGUF its architecture (timed in
docs/benchmarks.md). ``read_gguf`` decodes the same fields with one pass over the header (string
arrays in a Python loop over their bytes, numeric arrays as one ``frombuffer`` each) and maps
the tensors the way ``GGUFReader`` does, so a tensor's ``data`` is what
``gguf.quants.dequantize`` takes; ``tests/test_gguf_reader.py`` checks both readers agree on
every field and tensor of the GGUF files this project reads and writes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
#: scalar value types: (struct code, NumPy dtype code)
SCALARS = {
    UINT8: ("B", "u1"), INT8: ("b", "i1"), UINT16: ("H", "u2"), INT16: ("h", "i2"),
    UINT32: ("I", "u4"), INT32: ("i", "i4"), FLOAT32: ("f", "f4"), BOOL: ("?", "?"),
    UINT64: ("Q", "u8"), INT64: ("q", "i8"), FLOAT64: ("d", "f8"),
}  # fmt: skip
VERSIONS = (2, 3)  # the versions the gguf package reads (1 stored counts as 32-bit)
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class Field:
    """One key-value field: ``types`` as GGUFReader lists them (``[ARRAY, sub-type]`` for an
    array) and the decoded value (a list for an array)."""

    name: str
    types: tuple[int, ...]
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    """One tensor: ``shape`` GGUF's way (ne0 first), ``tensor_type`` a GGMLQuantizationType,
    ``data`` the file's bytes viewed as GGUFReader views them."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file's ``fields`` (name -> Field, in file order) and ``tensors``; the tensor data
    stays in the file (a read-only memory map) until used."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._buf = np.memmap(self.path, mode="r")
        self._mv = memoryview(self._buf)
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        (version,) = struct.unpack_from("<I", self._mv, 4)
        self.order = "<"
        if version & 0xFFFF == 0:  # written for the other byte order
            self.order = ">"
            (version,) = struct.unpack_from(">I", self._mv, 4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}: only versions 2 and 3 are read")
        self.version = version
        n_tensors, n_kv = self._unpack("QQ", 8)
        self._off = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            name = self._string()
            (vtype,) = self._take("I")
            types, value = self._value(vtype)
            self.fields[name] = Field(name, types, value)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._take("I")
            dims = self._take("Q" * n_dims)
            ggml_type, offset = self._take("IQ")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        align = self.fields.get("general.alignment")
        self.alignment = int(align.value) if align is not None else DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"general.alignment={self.alignment}: not a power of two")
        start = -(-self._off // self.alignment) * self.alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    # -- the header -------------------------------------------------------------------------
    def _unpack(self, fmt: str, off: int) -> tuple:
        return struct.unpack_from(self.order + fmt, self._mv, off)

    def _take(self, fmt: str) -> tuple:
        if self._off + struct.calcsize(self.order + fmt) > len(self._mv):
            raise ValueError(f"the header ends early (at byte {self._off} of {len(self._mv)})")
        out = self._unpack(fmt, self._off)
        self._off += struct.calcsize(self.order + fmt)
        return out

    def _string(self) -> str:
        (n,) = self._take("Q")
        if self._off + n > len(self._mv):
            raise ValueError(f"the header ends early (a {n}-byte string at byte {self._off})")
        s = bytes(self._mv[self._off : self._off + n]).decode("utf-8")
        self._off += n
        return s

    def _value(self, vtype: int) -> tuple[tuple[int, ...], Any]:
        if vtype in SCALARS:
            (v,) = self._take(SCALARS[vtype][0])
            return (vtype,), v
        if vtype == STRING:
            return (vtype,), self._string()
        if vtype != ARRAY:
            raise ValueError(f"value type {vtype} at byte {self._off}: not a GGUF type")
        sub, n = self._take("IQ")
        if sub in SCALARS:
            dt = np.dtype(SCALARS[sub][1]).newbyteorder(self.order)
            if self._off + n * dt.itemsize > len(self._mv):
                raise ValueError(f"the header ends early (an array of {n} at byte {self._off})")
            arr = np.frombuffer(self._mv, dtype=dt, count=n, offset=self._off)
            self._off += n * dt.itemsize
            return (ARRAY, sub), arr.tolist()
        if sub == STRING:
            return (ARRAY, sub), self._strings(n)
        items = [self._value(sub) for _ in range(n)]  # arrays of arrays
        return (ARRAY, *(items[0][0] if items else (sub,))), [v for _, v in items]

    def _strings(self, n: int) -> list[str]:
        mv, off, out = self._mv, self._off, []
        fmt = self.order + "Q"
        end = len(mv)
        for _ in range(n):
            if off + 8 > end:
                raise ValueError(f"the header ends early (at byte {off} of {end})")
            (k,) = struct.unpack_from(fmt, mv, off)
            off += 8
            if off + k > end:
                raise ValueError(f"the header ends early (a {k}-byte string at byte {off})")
            out.append(str(mv[off : off + k], "utf-8"))
            off += k
        self._off = off
        return out

    # -- the tensors ------------------------------------------------------------------------
    def _tensor(self, start: int, name: str, dims: tuple[int, ...], ggml_type: int, offset: int):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        T = GGMLQuantizationType
        qt = T(ggml_type)
        n_elems = int(np.prod(dims)) if dims else 1
        block, size = GGML_QUANT_SIZES[qt]
        n_bytes = n_elems * size // block
        shape = tuple(reversed(dims))
        plain = {T.F16: "f2", T.F32: "f4", T.F64: "f8", T.I8: "i1", T.I16: "i2", T.I32: "i4",
                 T.I64: "i8"}  # fmt: skip
        if qt in plain:
            dt, count = np.dtype(plain[qt]).newbyteorder(self.order), n_elems
        else:  # quantized and bf16: the raw bytes, one row of blocks a row
            dt, count = np.dtype("u1"), n_bytes
            shape = quant_shape_to_byte_shape(shape, qt)
        at = start + int(offset)
        if at + count * dt.itemsize > len(self._buf):
            raise ValueError(f"tensor {name}: its data runs past the end of the file")
        data = np.frombuffer(self._buf, dtype=dt, count=count, offset=at).reshape(shape)
        return Tensor(name, qt, dims, n_elems, n_bytes, at, data)


def read_gguf(path: str | Path) -> GGUFFile:
    """The GGUF at ``path``, its fields decoded and its tensors mapped (ValueError where the
    file is not a GGUF this reads)."""
    return GGUFFile(path)
