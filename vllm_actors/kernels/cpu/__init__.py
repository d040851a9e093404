"""The compiled CPU backend: numba kernels over weights kept in their GGUF formats."""
