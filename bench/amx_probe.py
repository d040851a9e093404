"""Whether this host's AMX int8 tiles run from user space, and how fast: a small C program
(compiled here with the system's gcc) asks Linux for the tile state (`arch_prctl`), checks
one 16 x 16 x 64 `TDPBUSD` tile product against a scalar one, and times `TDPBUSD` on four
independent accumulator tiles held in registers (the instruction's rate, no memory).

    python bench/amx_probe.py

What AMX would take in the engine, and why only some float orders allow it, is in
docs/BENCHMARKS.md ("AMX int8 tiles on this host"). Exits 1 where the CPU, the kernel or the
compiler lacks AMX.
"""

from __future__ import annotations

import subprocess
import sys

from c_program import built

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cfg_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
        return 1;
    }
    cfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    /* A: 16 rows of 64 unsigned bytes; B: 16 rows of 16 columns x 4 signed bytes (k / 4, j) */
    static uint8_t a[16][64];
    static int8_t b[16][64];
    static int32_t c[16][16], want[16][16];
    for (int i = 0; i < 16; ++i)
        for (int k = 0; k < 64; ++k) {
            a[i][k] = (uint8_t)(i * 7 + k * 3);
            b[i][k] = (int8_t)(i * 5 - k * 11);
        }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j)
            for (int k = 0; k < 64; ++k) want[i][j] += a[i][k] * b[k / 4][4 * j + k % 4];
    _tile_loadd(0, c, 64);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_stored(0, c, 64);
    int exact = memcmp(c, want, sizeof c) == 0;
    long n = 20000000;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    double t0 = now();
    for (long r = 0; r < n; ++r) {
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    double dt = now() - t0;
    _tile_release();
    printf("tile product: %s\n", exact ? "exact" : "WRONG");
    printf("TDPBUSD on one core: %.0f G MAC/s (4 accumulator tiles in registers, %.2f s)\n",
           4.0 * n * 16 * 16 * 64 / dt / 1e9, dt);
    return exact ? 0 : 1;
}
"""


def main() -> int:
    with built(SOURCE, ["-O2", "-mamx-tile", "-mamx-int8"]) as binary:
        return 1 if binary is None else subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    sys.exit(main())
