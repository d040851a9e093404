"""How many of the integer kernels' 512-bit instructions this host issues a cycle: a small C
program (compiled here with the system's gcc for this CPU) times long runs of independent
instructions, and the clock from a chain of dependent 64-bit multiplies (3 cycles each).

    python bench/vector_ports.py [--cores 2]

Rows: `vpdpbusd` with its operands in registers (12 independent accumulators), `vpdpbusd`
as the many-row kernels issue it (one 64-byte load of codes and one broadcast load of x
each), `vpmulld` (a sub-block's scale), `vpermt2w`, `vpdpwssd`, `vpaddd`. With --cores N the
program runs N times at once, one a core: equal rates mean the cores do not share ports.
What the numbers say about the kernels is in docs/BENCHMARKS.md ("Cache lines for the
kernels' vectors"). Exits 1 where the CPU or the compiler lacks AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from c_program import built

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int32_t xs[64] __attribute__((aligned(64)));
static char codes[512] __attribute__((aligned(64)));

#define RUN(name, count, body) do { \
        double t0 = now(); \
        for (long i = 0; i < n; ++i) { body; __asm__ volatile("" : "+v"(y)); } \
        printf("%-34s %.2f a cycle\n", name, (double)n * (count) / (now() - t0) / ghz / 1e9); \
    } while (0)

int main(void) {
    long n = 20000000;
    uint64_t m = 3;
    double t0 = now();
    for (long i = 0; i < n; ++i)
        __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(m));
    double ghz = n * 12.0 / (now() - t0) / 1e9;
    printf("clock (dependent imul, 3 cycles)    %.2f GHz\n", ghz);
    __m512i a[12], y = _mm512_set1_epi32(0x05060708), x = _mm512_set1_epi32(0x01020304);
    for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_epi32(j);
    RUN("vpdpbusd, registers", 12,
        for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbusd_epi32(a[j], x, y));
    RUN("vpdpbusd + 64-byte load + broadcast", 8,
        for (int j = 0; j < 8; ++j) a[j] = _mm512_dpbusd_epi32(
            a[j], _mm512_load_si512(codes + 64 * ((i + j) & 7)), _mm512_set1_epi32(xs[j + (i & 7)])));
    RUN("vpmulld", 12, for (int j = 0; j < 12; ++j) a[j] = _mm512_mullo_epi32(a[j], y));
    RUN("vpermt2w", 8,
        for (int j = 0; j < 8; ++j) a[j] = _mm512_permutex2var_epi16(a[j], x, y));
    RUN("vpdpwssd", 12, for (int j = 0; j < 12; ++j) a[j] = _mm512_dpwssd_epi32(a[j], x, y));
    RUN("vpaddd", 12, for (int j = 0; j < 12; ++j) a[j] = _mm512_add_epi32(a[j], y));
    int s = 0;
    for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_epi32(a[j]);
    return s == 12345 ? 2 : 0;
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=1, help="copies run at once")
    args = parser.parse_args()
    flags = ["-O3", "-funroll-loops", "-march=native", "-mavx512f", "-mavx512bw", "-mavx512vnni"]
    with built(SOURCE, flags) as binary:
        if binary is None:
            return 1
        runs = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True)
                for _ in range(args.cores)]
        for i, run in enumerate(runs):
            out, _ = run.communicate()
            print(f"copy {i + 1} of {args.cores}:\n{out}", end="")
            if run.returncode:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
