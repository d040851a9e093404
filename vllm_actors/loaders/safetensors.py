"""safetensors reader without torch: header, mmap, zero-copy views; BF16 kept as raw uint16.

Handles single files and sharded checkpoints (`model.safetensors.index.json`). The `safetensors`
package's numpy loader rejects BF16, which most checkpoints use, hence this small reader.
Format: 8-byte little-endian header length, a JSON header, then the data.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_actors.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError

# safetensors dtype -> (numpy storage dtype, GGML type id used as our common tag)
_DTYPES: dict[str, tuple[type, int]] = {
    "F32": (np.float32, 0), "F16": (np.float16, 1), "BF16": (np.uint16, 30),
}
_OTHER_DTYPES = {"F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16,
                 "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


@dataclass(frozen=True)
class SafetensorsEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # zero-copy view in the storage dtype


def _open_file(path: Path) -> dict[str, SafetensorsEntry]:
    size = path.stat().st_size
    if size < 8:
        raise ModelFormatError(path, f"file of {size} bytes is too short to be safetensors")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack_from("<Q", mm, 0)
    if 8 + header_len > size:
        raise ModelFormatError(path, f"truncated: header of {header_len} bytes in a {size}-byte file")
    try:
        header = json.loads(bytes(mm[8:8 + header_len]))
    except ValueError as e:
        raise ModelFormatError(path, f"header is not valid JSON ({e})") from None
    base = 8 + header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta["dtype"]
        storage = _DTYPES.get(dtype, (_OTHER_DTYPES.get(dtype), -1))[0]
        if storage is None:
            raise UnsupportedModelError(path, f"tensor {name!r} has unsupported dtype {dtype}")
        start, end = meta["data_offsets"]
        if base + end > size:
            raise ModelFormatError(path, f"truncated: tensor {name!r} ends at byte {base + end} "
                                         f"but the file has {size}")
        shape = tuple(int(d) for d in meta["shape"])
        count = (end - start) // np.dtype(storage).itemsize
        data = np.frombuffer(mm, dtype=storage, count=count, offset=base + start).reshape(shape)
        entries[name] = SafetensorsEntry(name, dtype, shape, data)
    return entries


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index file, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / shard for shard in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(missing[0], f"shard listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(model_dir, "no *.safetensors files in the model directory")
    return files


def load_safetensors(model_dir: Path) -> dict[str, SafetensorsEntry]:
    """All tensors of a (maybe sharded) checkpoint, by name, as zero-copy views."""
    tensors: dict[str, SafetensorsEntry] = {}
    for path in safetensors_files(model_dir):
        tensors.update(_open_file(path))
    return tensors


def ggml_type_of(dtype: str) -> int:
    """The GGML type id that tags a float safetensors dtype (F32=0, F16=1, BF16=30)."""
    return _DTYPES[dtype][1]
