"""A draft model for speculative decoding from a GGUF file: the same model with some layers
left out (the embedding, final norm and LM head kept), written as a new GGUF with the same
vocabulary, tokenizer and tensor types ("self-speculative" drafting by layer skipping, as in
Draft & Verify, arXiv 2309.08168; no training).

    python bench/draft_gguf.py SOURCE.gguf DEST.gguf --skip 5,9,13,17,21,25

Used by the speculative-decoding tests and `bench/spec_decode.py`: no separate small model
with SmolLM2's vocabulary ships on PyPI.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf


def write_draft(source: str | Path, dest: str | Path, skip: list[int]) -> Path:
    """Copy `source` without the layers in `skip` (the others renumbered); returns dest."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    kept = [i for i in range(total) if i not in set(skip)]
    if not kept or any(not 0 <= i < total for i in skip):
        raise ValueError(f"--skip must name layers in [0, {total}) and leave some")
    number = {old: new for new, old in enumerate(kept)}
    writer = gguf.GGUFWriter(str(dest), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.description"):
            continue
        value = len(kept) if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    writer.add_string("general.description", f"{Path(source).name} without layers "
                                             f"{sorted(skip)} (bench/draft_gguf.py)")
    for tensor in reader.tensors:
        name = tensor.name
        layer = re.match(r"blk\.(\d+)\.(.*)", name)
        if layer:
            if int(layer.group(1)) not in number:
                continue
            name = f"blk.{number[int(layer.group(1))]}.{layer.group(2)}"
        # quantized data comes as bytes per row, from which the writer derives the shape
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("dest")
    parser.add_argument("--skip", required=True, help="comma-separated layer indices")
    args = parser.parse_args()
    print(write_draft(args.source, args.dest, [int(i) for i in args.skip.split(",")]))


if __name__ == "__main__":
    main()
