"""A small, fast reader for GGUF files (metadata and memory-mapped tensor data).

gguf-py's ``GGUFReader`` builds a Python object per array element, which takes
about 3 s on a 49k-token vocabulary; this reader parses the same header in tens of
milliseconds and leaves tensor bytes memory-mapped until they are dequantized.
Dequantization itself is gguf-py's (``gguf.quants.dequantize``).

Layout (GGUF v2/v3, little endian): magic "GGUF", u32 version, u64 tensor count,
u64 metadata count, the metadata key/value pairs, the tensor infos (name, dims in
ggml order, type, offset), padding to ``general.alignment``, then tensor data.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from heron.utils import cdiv

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12

_SCALAR_FORMATS: dict[int, str] = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[int, str] = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "?",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file heron can read."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first), e.g. (out_features, in_features)
    ggml_type: int
    data_offset: int  # absolute offset in the file
    num_bytes: int


class GGUFFile:
    """Parsed metadata and tensor index of one GGUF file; tensor bytes stay mmapped."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.getsize(path) < 4:
            raise GGUFFormatError(f"{path} is not a GGUF file ({os.path.getsize(path)} bytes)")
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._data)  # type: ignore[arg-type]
        self._pos = 0
        if bytes(self._buffer[:4]) != _GGUF_MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
        try:
            self._parse()
        # a header cut short, or garbage in it: a length past any size, an unknown array type, an alignment of 0
        # (or metadata arrays nested past Python's recursion limit)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, KeyError, IndexError, TypeError,
                ZeroDivisionError, MemoryError, RecursionError) as exc:
            if isinstance(exc, GGUFFormatError):
                if path in str(exc):
                    raise
                raise GGUFFormatError(f"{path}: {exc}") from exc
            raise GGUFFormatError(f"{path}: the GGUF header is truncated or damaged ({exc}): "
                                  "an incomplete download or copy?") from exc
        finally:
            del self._buffer
        end = max((info.data_offset + info.num_bytes for info in self.tensors.values()), default=0)
        if end > len(self._data):
            raise GGUFFormatError(f"{path}: the tensor data ends {end - len(self._data)} bytes past the end of the "
                                  f"file ({len(self._data)} bytes): an incomplete download or copy?")

    def _parse(self) -> None:
        path = self.path
        self._pos = 4
        self.version = self._scalar(_UINT32)
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{path}: unsupported GGUF version {self.version}")
        tensor_count = self._scalar(_UINT64)
        kv_count = self._scalar(_UINT64)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            value_type = self._scalar(_UINT32)
            self.metadata[key] = self._value(value_type)
        raw_infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._scalar(_UINT32)
            dims = [self._scalar(_UINT64) for _ in range(n_dims)]
            ggml_type = self._scalar(_UINT32)
            offset = self._scalar(_UINT64)
            raw_infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = cdiv(self._pos, alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in raw_infos:
            if name in self.tensors:  # the later one won, and an error then named another tensor as missing
                raise GGUFFormatError(f"the file holds two tensors named {name!r}")
            if offset % alignment:  # as llama.cpp refuses it
                raise GGUFFormatError(f"tensor {name!r} starts at offset {offset}, not a multiple of the file's "
                                      f"alignment {alignment}")
            self.tensors[name] = GGUFTensorInfo(
                name=name,
                shape=tuple(reversed(dims)),
                ggml_type=ggml_type,
                data_offset=data_start + offset,
                num_bytes=_tensor_num_bytes(name, dims, ggml_type),
            )

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw_tensor(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 array of shape (rows, bytes per row)."""
        info = self.tensors[name]
        flat = self._data[info.data_offset : info.data_offset + info.num_bytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.num_bytes // rows)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in PyTorch order (dequantized if quantized)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {name}: unknown GGML type {info.ggml_type}") from exc
        if qtype == GGMLQuantizationType.F32:
            values = self.raw_tensor(name).view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            values = self.raw_tensor(name).view(np.float16).astype(np.float32)
        else:
            try:
                values = dequantize(self.raw_tensor(name), qtype)
            except NotImplementedError as exc:
                raise GGUFFormatError(
                    f"tensor {name}: GGML type {qtype.name} cannot be dequantized"
                ) from exc
        return np.asarray(values, dtype=np.float32).reshape(info.shape)

    # ---- parsing helpers -------------------------------------------------

    def _scalar(self, value_type: int) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, self._buffer, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buffer, self._pos)
        start = self._pos + 8
        self._pos = start + length
        return bytes(self._buffer[start : self._pos]).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type = self._scalar(_UINT32)
            count = self._scalar(_UINT64)
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[item_type])
            array = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._pos)
            self._pos += dtype.itemsize * count
            return array.tolist()
        if value_type in _SCALAR_FORMATS:
            return self._scalar(value_type)
        raise GGUFFormatError(f"unknown GGUF metadata value type {value_type}")


def _tensor_num_bytes(name: str, dims: list[int], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise GGUFFormatError(f"unknown GGML tensor type {ggml_type}") from exc
    if 0 in dims:  # (a division by zero in raw_tensor)
        raise GGUFFormatError(f"tensor {name!r} has a dimension of 0 ({dims})")
    if dims and dims[0] % block_size:  # a row is whole blocks (it failed later as a reshape, with no path)
        raise GGUFFormatError(f"tensor {name!r} has rows of {dims[0]} values, not a whole number of its type's "
                              f"blocks of {block_size}")
    # Python's integers: numpy's int64 product wrapped to 0 for dimensions of 2^32 x 2^32, and the check that
    # the data lies inside the file passed
    return math.prod(dims) // block_size * type_size


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file, shared by everyone who reads it in this process (config,
    quantization choice, tokenizer: parsing the embedded model's 49k-token
    vocabulary costs about 0.4 s); a file changed on disk is parsed again."""
    stat = os.stat(path)
    return _open_cached(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
