"""ggml's precomputed float16 GELU table, read out of the ggml library that llama-cpp-python
ships (`ggml_table_gelu_f16`, filled by `ggml_cpu_init`): what llama.cpp's GeGLU looks up for
every float16 input. Tests compare `kernels.ggml_math.gelu_table` with it, all 65,536 entries,
without llama.cpp installed. Run by hand:

    pip install -e ".[oracle]"
    python tests/oracle/make_ggml_tables_golden.py

Writes tests/golden/ggml_gelu_f16.npz: gelu (uint16 [65536], float16 bits) and
meta/llama_cpp_version.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ggml_gelu_f16.npz"


def main() -> None:
    import llama_cpp
    llama_cpp.llama_backend_init()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib",
                                   "libggml-cpu.so"))
    lib.ggml_cpu_init()
    table = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16"))
    np.savez_compressed(GOLDEN, gelu=table.copy(),
                        **{"meta/llama_cpp_version":
                           np.array(importlib.metadata.version("llama_cpp_python"))})
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
