"""GGUF reader: header, metadata, tensor infos and one read-only mmap of the tensor data.

Our own parser because gguf-py's `GGUFReader` builds two memmaps per vocabulary string
(seconds on a 49k-token vocabulary); this one reads the header with `struct` and takes tensor
data as zero-copy numpy views. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from vllm_actors.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    `shape` is in numpy order (outermost first); GGUF stores dims innermost first.
    `offset` is absolute in the file; `nbytes` is the size of the stored (maybe quantized) data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class _Cursor:
    """Sequential little-endian reader over a buffer that reports truncation as a format error."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ModelFormatError(self.path, f"truncated GGUF header at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ModelFormatError(self.path, f"truncated GGUF header at byte {self.pos}")
        raw = self.buf[self.pos:end]
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ModelFormatError(self.path, f"unknown GGUF metadata value type {vtype}")
        return self.unpack(fmt)

    def _string_array(self, count: int) -> list[str]:
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack_len = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (length,) = unpack_len(buf, pos)
                pos += 8
                append(buf[pos:pos + length].decode("utf-8", errors="replace"))
                pos += length
        except struct.error:
            pos = size + 1
        if pos > size:
            raise ModelFormatError(self.path, f"truncated GGUF header at byte {self.pos}")
        self.pos = pos
        return out

    def array(self) -> Any:
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if item_type == _STRING:
            return self._string_array(count)
        if item_type == _ARRAY:
            return [self.array() for _ in range(count)]
        dtype = _NUMPY_DTYPES.get(item_type)
        if dtype is None:
            raise ModelFormatError(self.path, f"unknown GGUF array item type {item_type}")
        nbytes = count * np.dtype(dtype).itemsize
        if self.pos + nbytes > len(self.buf):
            raise ModelFormatError(self.path, f"truncated GGUF header at byte {self.pos}")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += nbytes
        return values


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    sizes = GGML_QUANT_SIZES.get(_quant_type(ggml_type))
    if sizes is None:
        raise UnsupportedModelError(path, f"tensor {name!r} has unknown GGML type {ggml_type}")
    block_size, type_size = sizes
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ModelFormatError(path, f"tensor {name!r}: row of {row} is not a multiple of the "
                                     f"block size {block_size}")
    num_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return num_rows * (row // block_size) * type_size


def _quant_type(ggml_type: int) -> GGMLQuantizationType | None:
    try:
        return GGMLQuantizationType(ggml_type)
    except ValueError:
        return None


class GGUFFile:
    """An open GGUF file: `metadata` (dict), `tensors` (name -> GGUFTensorInfo), raw data views.

    Args:
        path: the .gguf file.
    Raises:
        ModelNotFoundError: the file does not exist.
        ModelFormatError: wrong magic, unsupported version, truncated header or data.
        UnsupportedModelError: a tensor of a GGML type this gguf package does not know.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(self.path, "no such GGUF file")
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            if size < 24:
                raise ModelFormatError(self.path, f"file of {size} bytes is too short to be GGUF")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.path)
        if self._mmap[:4] != GGUF_MAGIC:
            raise ModelFormatError(self.path, f"not a GGUF file (magic {bytes(self._mmap[:4])!r})")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelFormatError(self.path, f"unsupported GGUF version {version} (want 2 or 3)")
        num_tensors = cur.unpack("<Q")
        num_kv = cur.unpack("<Q")
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        raw_infos = []
        for _ in range(num_tensors):
            name = cur.string()
            num_dims = cur.unpack("<I")
            dims = [cur.unpack("<Q") for _ in range(num_dims)]
            ggml_type = cur.unpack("<I")
            rel_offset = cur.unpack("<Q")
            raw_infos.append((name, tuple(reversed(dims)), ggml_type, rel_offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // alignment) * alignment
        file_size = len(self._mmap)
        for name, shape, ggml_type, rel_offset in raw_infos:
            nbytes = _tensor_nbytes(self.path, name, shape, ggml_type)
            offset = self.data_offset + rel_offset
            if offset + nbytes > file_size:
                raise ModelFormatError(
                    self.path, f"truncated: tensor {name!r} needs bytes up to {offset + nbytes} "
                               f"but the file has {file_size}")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(self.path, "metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """Metadata under the architecture's prefix, e.g. arch_get("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's stored bytes as uint8 rows `[num_rows, row_bytes]`
        (float types are viewed with their dtype and logical shape instead)."""
        info = self.tensors[name]
        data = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        dtype = plain.get(_quant_type(info.ggml_type))
        if dtype is not None:
            return data.view(dtype).reshape(info.shape)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)

    def close(self) -> None:
        self._mmap.close()
