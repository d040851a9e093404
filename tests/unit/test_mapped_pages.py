"""`kernels.mapped_pages.release`: a file mapping's pages leave this process and its bytes
stay readable; memory that is not a file mapping is never touched."""

from __future__ import annotations

import mmap

import numpy as np

from vllm_actors.kernels import mapped_pages


def _rss_kib(address: int) -> int:
    """Resident KiB of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_release_drops_mapped_pages_and_keeps_the_bytes(tmp_path):
    payload = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    payload.tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mm, np.uint8)
    weight = data[12345:].reshape(-1, 7)[:1000000]          # a view, not page-aligned
    assert int(data.sum(dtype=np.int64)) == int(payload.sum(dtype=np.int64))
    before = _rss_kib(data.ctypes.data)
    mapped_pages.release(weight)
    after = _rss_kib(data.ctypes.data)
    assert before >= 8 << 10 and before - after >= weight.nbytes // 1024 - 8
    assert np.array_equal(data, payload)                     # read back from the file
    anonymous = payload.copy()
    mapped_pages.release(anonymous)                          # not a mapping: left alone
    mapped_pages.release(anonymous[::2])
    assert np.array_equal(anonymous, payload)
    del data, weight
    mm.close()
