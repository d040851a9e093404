"""Compute backends behind one contract (`ops.Backend`); numpy is the reference."""

from __future__ import annotations

from vllm_actors.kernels.ops import Backend

BACKENDS = ("numpy",)


def get_backend(name: str = "numpy") -> Backend:
    """The backend called `name`.

    Raises:
        ValueError: an unknown backend name.
    """
    if name == "numpy":
        from vllm_actors.kernels.numpy_backend import NumpyBackend
        return NumpyBackend()
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
