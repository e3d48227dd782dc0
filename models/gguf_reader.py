"""A lean GGUF reader: the metadata as Python values and each tensor as a byte view of one memmap.

    f = GGUFFile("model.gguf")
    f.fields["general.architecture"]                   # 'gemma3'
    t = f.tensor("token_embd.weight")                  # t.shape: numpy order ([out, in]); t.qtype
    w = t.dequantize()                                 # float32 [out, in] (gguf.quants.dequantize)

Format (GGUF v2/v3, little-endian; llama.cpp's gguf.md): magic "GGUF", version u32, tensor count
u64, metadata count u64; each key/value is a string key, a u32 type and the value (strings are a
u64 length + UTF-8 bytes; arrays a u32 item type, a u64 count and the items); then per tensor its
name, u32 n_dims, n_dims u64 dims (fastest-first), u32 type and u64 offset into the data section,
which starts at the next multiple of ``general.alignment`` (default 32). Numeric arrays are read
with one ``np.frombuffer``; the ``gguf`` package's ``GGUFReader`` builds Python objects per array
element, which made opening Gemma 3's 262k-token vocabulary take ~13-50 s here (docs/models.md).
Dequantisation is the ``gguf`` package's (every legacy and K-quant type it knows).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_NUMERIC = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}  # 7: bool (one byte)
_BOOL = 7


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple  # numpy order: the GGUF dims reversed ([out, in] for a linear)
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # the raw bytes (uint8 view of the file)

    def dequantize(self) -> np.ndarray:
        """float32 values in ``shape`` (exact for every block format: scales are f16/f32)."""
        import gguf

        block, type_bytes = gguf.GGML_QUANT_SIZES[self.qtype]
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        raw = self.data.reshape(rows, self.shape[-1] // block * type_bytes)
        return np.asarray(gguf.quants.dequantize(raw, self.qtype), np.float32).reshape(self.shape)


class GGUFFile:
    """Metadata (``fields``: key -> int | float | bool | str | list | np.ndarray) and tensors."""

    def __init__(self, path):
        import gguf

        self.path = os.fspath(path)
        self._mm = np.memmap(self.path, np.uint8, mode="r")
        self._pos = 0
        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r})")
        self._pos = 4
        version = self._scalar("<u4")
        if version not in (2, 3):
            raise ValueError(
                f"{self.path}: GGUF version {version} is not supported "
                f"(expected 2 or 3, little-endian)"
            )
        n_tensors, n_kv = self._scalar("<u8"), self._scalar("<u8")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<u4"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<u8") for _ in range(self._scalar("<u4"))]
            infos.append(
                (
                    name,
                    tuple(int(d) for d in reversed(dims)),
                    self._scalar("<u4"),
                    self._scalar("<u8"),
                )
            )
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, shape, qtype, offset in infos:
            qtype = gguf.GGMLQuantizationType(qtype)
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape, dtype=np.int64))
            if shape and shape[-1] % block:
                raise ValueError(
                    f"{self.path}: tensor {name!r} row of {shape[-1]} is not a whole number of "
                    f"{qtype.name} blocks of {block}"
                )
            begin = start + int(offset)
            end = begin + n // block * type_bytes
            if end > self._mm.size:
                raise ValueError(
                    f"{self.path}: tensor {name!r} ends at byte {end}, "
                    f"past the file ({self._mm.size})"
                )
            self.tensors.append(GGUFTensor(name, shape, qtype, self._mm[begin:end]))

    def tensor(self, name: str) -> GGUFTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.path}: no tensor {name!r}")

    # ------------------------------------------------------------------ parsing
    def _take(self, n: int) -> np.ndarray:
        out = self._mm[self._pos : self._pos + n]
        if out.size != n:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self._pos}")
        self._pos += n
        return out

    def _scalar(self, fmt: str):
        return np.frombuffer(self._take(np.dtype(fmt).itemsize), fmt)[0].item()

    def _string(self) -> str:
        return bytes(self._take(self._scalar("<u8"))).decode("utf-8")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._scalar("<u4"), self._scalar("<u8")
            if item in _NUMERIC:
                dt = np.dtype(_NUMERIC[item])
                arr = np.frombuffer(self._take(count * dt.itemsize), dt)
                return arr.astype(bool) if item == _BOOL else arr
            if item == _STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        if vtype in _NUMERIC:
            v = self._scalar(_NUMERIC[vtype])
            return bool(v) if vtype == _BOOL else v
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, out = self._mm, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        raw = memoryview(buf)
        for _ in range(count):
            (n,) = unpack(raw, pos)
            out.append(bytes(raw[pos + 8 : pos + 8 + n]).decode("utf-8"))
            pos += 8 + n
        if pos > buf.size:
            raise ValueError(f"{self.path}: truncated string array")
        self._pos = pos
        return out


def gguf_fields_as_python(fields: dict) -> dict:
    """``fields`` with numpy arrays turned into lists (for JSON / comparisons)."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
