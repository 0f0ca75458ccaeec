"""What fresh memory costs on this machine, on huge pages and on small ones, in fresh processes.

    python bench/page_cost.py [--processes 6] [--mib 500]

Each fresh process takes ``--mib`` MiB with ``np.zeros`` (numpy marks arrays of 4 MiB and up
for transparent huge pages), pays for every page at once with ``madvise(MADV_POPULATE_WRITE)``
(what the replay buffer's constructor does), then writes it front to back in rows of 256
bytes, 256 rows a call (the replay's first fill, in numpy). The ``small`` processes first
take the huge-page mark off (``MADV_NOHUGEPAGE``). The two kinds alternate, in turns that
change which goes first.

It separates what the pages cost from what writing them costs: on a VM whose host takes
back the memory a guest frees (free page reporting, a balloon), a huge page tends to be
carved from such memory and its first touch faults in the host, while small pages mostly
come from memory the guest still holds. Linux only (madvise numbers of x86-64 and arm64).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

from first_fill import alternating  # bench/ is the script's directory

MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 15, 23


def _child(kind: str, mib: int) -> dict:
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    n = mib << 20
    t0 = time.perf_counter()
    a = np.zeros(n, np.uint8)
    lo = (a.ctypes.data + 4095) & ~4095
    hi = (a.ctypes.data + n) & ~4095
    if kind == "small":
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_NOHUGEPAGE)
    rc = libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_POPULATE_WRITE)
    if rc != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed (Linux >= 5.14 needed)")
    t1 = time.perf_counter()
    rows = a[: n // 256 * 256].view(np.float32).reshape(-1, 64)
    chunk = np.ones((256, 64), np.float32)
    for i in range(0, len(rows), 256):
        rows[i : i + 256] = chunk[: len(rows) - i]
    t2 = time.perf_counter()
    return {"kind": kind, "pay_s": t1 - t0, "write_s": t2 - t1}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["huge", "small"], help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=6)
    p.add_argument("--mib", type=int, default=500)
    a = p.parse_args(argv)
    if a.processes < 1 or a.mib < 4:
        p.error("--processes at least 1, --mib at least 4")
    if a.child:
        print(json.dumps(_child(a.child, a.mib)))
        return 0
    runs = alternating(__file__, ("huge", "small"), a.processes, ("--mib", str(a.mib)))
    print("| pages | pay for them, s (each process) | write them, ms (each process) |")
    print("|---|---|---|")
    for kind, rs in runs.items():
        pay = ", ".join(f"{r['pay_s']:.2f}" for r in rs)
        write = ", ".join(f"{r['write_s'] * 1e3:.1f}" for r in rs)
        print(f"| {kind} | {pay} | {write} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
