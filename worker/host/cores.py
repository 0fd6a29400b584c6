"""How many cores this worker may use: what its thread and process defaults are sized by.

`os.cpu_count()` counts the machine's cores. A worker pinned with `taskset`, or in a container given a
cpuset or a CPU limit (`docker run --cpus 2`, a Kubernetes limit, systemd's CPUQuota) may use fewer:
sized by the machine, a 2-CPU pod on a 64-core node would start 33 processes and be throttled."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores of this process's CPU affinity, capped by its cgroup's CPU quota (rounded up); at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_quota(Path("/proc/self/cgroup"), CGROUP)
    return max(1, min(n, math.ceil(quota)) if quota is not None else n)


def cgroup_quota(own: Path, root: Path) -> float | None:
    """The CPU quota, in cores, of the cgroup `own` (/proc/self/cgroup) names under the hierarchy at `root`
    (cgroup v2's cpu.max, "200000 100000"; v1's cpu.cfs_quota_us over cpu.cfs_period_us), looked up from the
    process's own group to the root as the kernel applies them: the smallest. None when there is none."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2, the unified hierarchy
            found += [q for d in _up(root, group) if (q := _v2(d / "cpu.max")) is not None]
        elif "cpu" in controllers.split(","):
            for d in _up(root / controllers, group) + _up(root / "cpu", group):
                q = _v1(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us")
                if q is not None:
                    found.append(q)
    return min(found) if found else None


def _up(base: Path, group: str) -> list[Path]:
    """base/group and each folder above it up to base (a container sees its own group as the root)."""
    parts = [p for p in group.strip("/").split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
