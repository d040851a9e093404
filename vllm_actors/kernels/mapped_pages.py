"""Giving back a file mapping's pages once a weight's bytes have been copied out of it.

GGUF and safetensors files are read through one read-only shared mapping. The compiled CPU
backend copies every weight into planes of its own, after which the mapped pages only add to
the resident size: a Llama-3-8B-shaped Q4_K_M peaked at the file plus its copy while it
loaded. `release` drops the pages under an array from this process (`MADV_DONTNEED`). For a
shared file mapping nothing is lost: a later read faults the bytes back in from the page
cache or the file. Arrays that are not views of a file mapping are left alone, since the same
advice zeroes private anonymous memory.
"""

from __future__ import annotations

import mmap

import numpy as np


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The mmap an array views, following its bases; None for any other memory."""
    base: object = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None


def release(array: np.ndarray) -> None:
    """Drop the pages under `array` (C-contiguous, a view of a read-only mmap) from this
    process; a no-op for any other array, or where the platform has no `madvise`."""
    mm = _mapping(array)
    if mm is None or mm.closed or array.nbytes == 0 or not array.flags.c_contiguous \
            or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    offset = array.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data
    start = offset - offset % mmap.PAGESIZE
    mm.madvise(mmap.MADV_DONTNEED, start, min(len(mm), offset + array.nbytes) - start)
