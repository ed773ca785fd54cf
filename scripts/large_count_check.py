"""One allreduce of more than 2**31 - 1 elements (a 2.1 GB uint8 array), the case MPI's int counts
cannot take in one call (Open MPI 5 fails it with MPI_ERR_ARG; gradsync splits it).

    mpiexec -n 2 python scripts/large_count_check.py [--elements N]

Needs about 2 x N bytes of memory per rank (the array, MPI's own buffers). Prints one line per rank,
``rank R: PASS <seconds> s`` or ``rank R: FAIL <why>``; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import gradsync


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2**31 + 1000,
                        help="uint8 elements to allreduce (default 2**31 + 1000)")
    args = parser.parse_args()
    gradsync.init()
    rank, size = gradsync.rank(), gradsync.size()
    data = np.ones(args.elements, np.uint8)
    data[-1] = rank  # the last element tells whether the tail beyond 2**31 moved too
    started = time.perf_counter()
    gradsync.allreduce_(data, name="large", op=gradsync.Sum)
    took = time.perf_counter() - started
    want_tail = sum(range(size)) % 256
    ok = data[0] == size and data[2**31 - 1 if args.elements > 2**31 else 0] == size \
        and data[-1] == want_tail and int(np.count_nonzero(data[:-1] != size)) == 0
    why = "" if ok else f"data[0]={data[0]}, data[-1]={data[-1]} (want {size}, {want_tail})"
    print(f"rank {rank}: {'PASS' if ok else 'FAIL'} {took:.1f} s {why}".rstrip(), flush=True)
    gradsync.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
