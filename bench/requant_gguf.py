"""A GGUF file with its matrices requantized to another type (metadata, tokenizer and the
other tensors copied), for benchmarks of types no PyPI model ships in. Run:

    python bench/requant_gguf.py SRC.gguf DST.gguf --type IQ4_NL

Every 2-D tensor whose rows are whole 32-weight blocks is dequantized (gguf-py) and
requantized: IQ4_NL with `tests/quant_blocks.quantize_iq4_nl` (the nearest table value per
weight: a valid encoding, not llama.cpp's search, so the model's quality is not measured),
Q4_0 / Q8_0 with gguf-py. `general.file_type` is dropped (it would name the source's mix).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_blocks import quantize_iq4_nl  # noqa: E402


def requantize(values: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.IQ4_NL:
        return quantize_iq4_nl(values)
    return gguf_quants.quantize(values, qtype)


def copy_fields(reader: GGUFReader, writer: GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--type", default="IQ4_NL", choices=("IQ4_NL", "Q4_0", "Q8_0"))
    args = parser.parse_args()
    target = T[args.type]
    reader = GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(args.dst, arch)
    copy_fields(reader, writer)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))   # rows first
        data = np.asarray(tensor.data)
        if len(shape) == 2 and shape[1] % 32 == 0 and tensor.tensor_type != target:
            dense = gguf_quants.dequantize(data, tensor.tensor_type).reshape(shape)
            writer.add_tensor(tensor.name, requantize(dense.astype(np.float32), target),
                              raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, data, raw_shape=shape,
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
