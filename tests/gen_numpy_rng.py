#!/usr/bin/env python3
"""Reference values from numpy for tests/test_engram.c (run by the test at test time).

Prints one case per line, all numbers in decimal:
  G seed n  w0 .. w{n-1}          SeedSequence(seed).generate_state(n, np.uint32)
  S seed  state_hi state_lo inc_hi inc_lo
                                  PCG64(seed) state right after seeding (the 128-bit state and
                                  increment split into high and low 64-bit halves)
  R seed n  r0 .. r{n-1}          PCG64(seed).random_raw(n)
  I seed low high n  v0 .. v{n-1} default_rng(seed).integers(low, high, n, dtype=np.int64)
  M vocab layer_id N  m0 .. m{N-1}
                                  engram multipliers: integers(0, bound, N) * 2 + 1 with
                                  seed 10007*layer_id, bound = max(1, (INT64_MAX // vocab) // 2)
Exit status 77 when numpy cannot be imported (the test then skips this sub-case).
"""
import random
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover
    print("numpy not available", file=sys.stderr)
    sys.exit(77)

INT64_MAX = np.iinfo(np.int64).max


def seeds():
    out = [0, 1, 2, 42, 12345, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 12345, 2**63 - 1, 2**64 - 1]
    out += [10007 * k for k in range(0, 64)]
    r = random.Random(20240601)
    for bits in (8, 16, 31, 32, 33, 48, 63, 64):
        out += [r.getrandbits(bits) for _ in range(3)]
    return list(dict.fromkeys(out))  # unique, first-seen order


def bounds():
    # (low, high): tiny / V4.1-Flash multiplier bounds, every branch of numpy's
    # random_bounded_uint64_fill (rng = 0, < 2^32 - 1, = 2^32 - 1, > 2^32 - 1, 2^64 - 2).
    b = []
    for vocab in (300, 99092, 1, 2, 7, 129280):
        b.append((0, max(1, (INT64_MAX // vocab) // 2)))
    b += [(0, 1), (5, 6), (0, 2), (0, 3), (0, 1000), (-5, 7), (0, 2**31), (0, 2**31 + 1),
          (0, 2**32 - 1), (0, 2**32), (0, 2**32 + 1), (-(2**31), 2**31), (0, 2**33 + 3),
          (0, 2**62), (0, 2**62 + 1), (0, INT64_MAX), (-(2**63), INT64_MAX), (-1000, -10)]
    return b


def main():
    ss = seeds()
    for s in ss[:24]:
        w = np.random.SeedSequence(s).generate_state(8, np.uint32)
        print("G", s, len(w), *[int(x) for x in w])
    for s in ss:
        st = np.random.PCG64(s).state["state"]
        mask = (1 << 64) - 1
        print("S", s, st["state"] >> 64, st["state"] & mask, st["inc"] >> 64, st["inc"] & mask)
    for s in ss[:24]:
        r = np.random.PCG64(s).random_raw(6)
        print("R", s, len(r), *[int(x) for x in r])
    for i, s in enumerate(ss):
        for j, (lo, hi) in enumerate(bounds()):
            if (i + j) % 3 and s not in (0, 20014, 40028, 140098):
                continue  # a deterministic subset keeps the output small
            n = (3, 4, 7, 17)[(i + j) % 4]
            v = np.random.default_rng(s).integers(lo, hi, n, dtype=np.int64)
            print("I", s, lo, hi, n, *[int(x) for x in v])
    for vocab in (300, 99092):
        for layer in (0, 1, 2, 4, 14, 20, 42):
            for nmax in (3, 4):
                bound = max(1, (INT64_MAX // vocab) // 2)
                g = np.random.default_rng(10007 * layer)
                m = g.integers(low=0, high=bound, size=(nmax,), dtype=np.int64) * 2 + 1
                print("M", vocab, layer, nmax, *[int(x) for x in m])
    return 0


if __name__ == "__main__":
    sys.exit(main())
