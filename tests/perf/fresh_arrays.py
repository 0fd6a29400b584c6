"""How long filling fresh numpy arrays takes in a new thread, with numpy's transparent-huge-page advice on
or off (not a test).

    python tests/perf/fresh_arrays.py on|off

numpy asks the kernel for huge pages on arrays of 4 MB and more (madvise); where the kernel's THP
`defrag` setting is `madvise` (this machine's), a fault in such an array may compact memory first.
Prints the milliseconds for 15, 30, 40 and 60 MB arrays of ones, each allocated and touched once.
Run it in alternation, a fresh process each time: the stalls come and go.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

mode = sys.argv[1] if len(sys.argv) > 1 else "on"
core = getattr(np, "_core", None) or np.core  # numpy 2 | 1
core.multiarray._set_madvise_hugepage(mode == "on")  # as NUMPY_MADVISE_HUGEPAGE=0|1 at import
out: list[tuple[int, float]] = []


def work() -> None:
    for mb in (15, 30, 40, 60):
        n = mb * (1 << 20) // 4
        t = time.perf_counter()
        a = np.ones(n, np.float32)  # fresh, touched
        out.append((mb, (time.perf_counter() - t) * 1000))
        del a


t = threading.Thread(target=work)
t.start()
t.join()
print(mode, " ".join(f"{mb}MB:{ms:.1f}" for mb, ms in out))
