"""The cores the worker sizes its defaults by (worker.host.cores): a process pinned to one core sizes its
threads and processes for one; a cgroup's CPU quota, read from files laid out as the kernel lays them out
(v2's cpu.max, v1's cfs quota and period, nested groups), caps them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from worker.host.cores import cgroup_quota

ONE_CORE = """
import json
from worker.host.cores import usable_cores
from worker.pipeline.shards import default_processes
from worker.runtime.engine import default_threads
print(json.dumps([usable_cores(), default_processes(), default_threads()]))
"""


def test_a_worker_pinned_to_one_core_sizes_its_defaults_for_one() -> None:
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", ONE_CORE], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {first}))  # as `taskset -c N` starts it
    assert json.loads(out.stdout) == [1, 1, [1, 1]]


def _group(root: Path, group: str, name: str, text: str) -> None:
    folder = root / group.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def test_cgroup_v2_quota_is_the_smallest_from_the_group_up(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/worker.service\n")
    root = tmp_path / "fs"
    _group(root, "", "cpu.max", "max 100000\n")
    _group(root, "system.slice", "cpu.max", "400000 100000\n")
    _group(root, "system.slice/worker.service", "cpu.max", "150000 100000\n")  # systemd's CPUQuota=150%
    assert cgroup_quota(own, root) == 1.5
    _group(root, "system.slice/worker.service", "cpu.max", "max 100000\n")
    assert cgroup_quota(own, root) == 4.0
    _group(root, "system.slice", "cpu.max", "max 100000\n")
    assert cgroup_quota(own, root) is None


def test_cgroup_v1_quota_and_a_container_s_own_root(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    own.write_text("12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "fs"
    _group(root, "cpu,cpuacct", "cpu.cfs_quota_us", "200000\n")  # inside the container its group is the root
    _group(root, "cpu,cpuacct", "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(own, root) == 2.0
    _group(root, "cpu,cpuacct", "cpu.cfs_quota_us", "-1\n")  # no limit
    assert cgroup_quota(own, root) is None
    assert cgroup_quota(tmp_path / "none", root) is None  # not Linux, or no /proc
