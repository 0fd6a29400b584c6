"""GPU facts: which onnxruntime build is installed, CUDA-to-NVML device numbering, GPU memory samples.

No GPU here: the NVML calls are exercised through a stand-in for the driver (`_Nvml`), and what a
CUDA run records is checked end to end from the database (samples with GPU bytes -> `worker stats`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from click.testing import CliRunner
from sqlalchemy.orm import Session

from worker.cli import cli
from worker.runtime.gpu import GpuMemory, conflicting_builds, installed_onnxruntime_builds, nvml_index
from worker.host.memory import MemorySampler
from worker.store.db import open_db
from worker.store.stats import run_stats
from worker.store.schema import MemorySample, Run


def test_exactly_one_onnxruntime_build_is_installed_here() -> None:
    builds = installed_onnxruntime_builds()
    assert len(builds) == 1, builds
    assert conflicting_builds(builds) is None


def _start_engine(tmp_path: Path, effnet_onnx: Path, settings: str) -> subprocess.CompletedProcess:
    """A session made as a start makes it, in a process of its own: everything it writes, onnxruntime's own
    native error lines included, is captured."""
    script = (f"import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
              f"from worker.config import EngineConfig\nfrom worker.runtime.engine import Engine\n"
              f"e = Engine({str(effnet_onnx)!r}, EngineConfig({settings}), 1)\nprint('active', e.providers)\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_a_machine_without_a_gpu_is_said_in_one_line(tmp_path: Path, effnet_onnx: Path) -> None:
    """The install is the GPU build where PyPI has one (as here): on a machine with no NVIDIA driver, CUDA is not
    asked for (onnxruntime would print its multi-line load error), one line says why, and the CPU runs it; with
    require_gpu the start is refused, with the reason. The CPU build says nothing: CPU is all it has."""
    proc = _start_engine(tmp_path, effnet_onnx, "")
    assert proc.returncode == 0 and "active ['CPUExecutionProvider']" in proc.stdout, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "CUDA" in line or "onnxruntime:" in line]
    if installed_onnxruntime_builds() == ("onnxruntime-gpu",):
        assert len(said) == 1 and said[0].endswith(
            "CUDA not available here (no NVIDIA driver: libcuda.so.1 not found): running on CPU"), proc.stderr
    else:
        assert said == [], proc.stderr
    refused = _start_engine(tmp_path, effnet_onnx, "require_gpu=True")
    assert refused.returncode == 1 and "ProviderError: CUDA requested but not available here (" in refused.stderr
    assert ("no NVIDIA driver" if installed_onnxruntime_builds() == ("onnxruntime-gpu",) else "no CUDA provider") \
        in refused.stderr
    assert "[E:onnxruntime" not in refused.stderr + proc.stderr


def test_two_builds_are_named_with_the_way_out() -> None:
    message = conflicting_builds(["onnxruntime", "onnxruntime-gpu"])
    assert message is not None
    assert message.startswith("onnxruntime, onnxruntime-gpu are installed together")
    assert message.endswith("pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu")


def test_cuda_device_numbers_map_to_nvml_through_cuda_visible_devices() -> None:
    assert nvml_index(0, None) == 0
    assert nvml_index(1, "") == 1
    assert nvml_index(0, "2,3") == 2
    assert nvml_index(1, "2, 3") == 3
    assert nvml_index(0, "GPU-8f6c0d2a-1b2c") == "GPU-8f6c0d2a-1b2c"
    assert nvml_index(3, "1") == 3  # out of range: left to NVML to refuse


class _Nvml:
    """Stands in for the NVIDIA driver's library (the part of the machine this one lacks)."""

    def __init__(self, processes: list[Any], used: int, fail_init: bool = False) -> None:
        self.processes, self.used, self.fail_init = processes, used, fail_init
        self.opened: list[Any] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.opened.append(index)
        return f"handle-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.opened.append(uuid)
        return f"handle-{uuid}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        if isinstance(self.processes, Exception):
            raise self.processes
        return self.processes

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(used=self.used)


def test_gpu_memory_is_this_process_s_or_else_the_device_s(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    me = SimpleNamespace(pid=os.getpid(), usedGpuMemory=300 << 20)
    other = SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=5 << 30)
    nvml = _Nvml([other, me], used=6 << 30)
    assert GpuMemory(0, nvml)() == 300 << 20
    assert nvml.opened == [1]  # CUDA device 0 is NVML device 1 here
    caplog.set_level(logging.INFO, logger="worker.runtime.gpu")
    alone = GpuMemory(0, _Nvml([other], used=6 << 30))  # our PID not listed (a container's own PID namespace)
    assert alone() == 6 << 30 and alone() == 6 << 30
    assert sum("whole device" in r.getMessage() for r in caplog.records) == 1


def test_gpu_memory_is_none_without_nvml_or_when_it_fails(caplog) -> None:
    assert GpuMemory(0, _Nvml([], used=1, fail_init=True))() is None
    assert "NVML cannot open CUDA device 0" in caplog.text
    assert GpuMemory(0, _Nvml(RuntimeError("driver hiccup"), used=1))() is None  # type: ignore[arg-type]
    try:
        import pynvml  # noqa: F401
    except ImportError:  # this machine: no nvidia-ml-py, so no NVML at all
        caplog.set_level(logging.INFO, logger="worker.runtime.gpu")
        assert GpuMemory(0)() is None
        assert "pip install nvidia-ml-py" in caplog.text


def test_sampler_records_gpu_bytes_when_given_a_probe() -> None:
    got: list[Any] = []
    sampler = MemorySampler(60.0, got.append, lambda: (0, 0), gpu=lambda: 123 << 20)
    sampler.stop()
    assert [s.gpu_bytes for s in got] == [123 << 20, 123 << 20]  # the first sample and the one at stop
    got.clear()
    MemorySampler(60.0, got.append, lambda: (0, 0)).stop()
    assert [s.gpu_bytes for s in got] == [None, None]


def test_stats_report_gpu_memory_when_samples_have_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    db = open_db(url)
    t0 = datetime(2026, 11, 30, tzinfo=timezone.utc)
    with Session(db) as session:
        for name, gpu in (("cpu-run", lambda s: None), ("cuda-run", lambda s: (500 + 20 * s / 3600) * 2**20)):
            run = Run(mode="run", host="h", pid=1, root="/", model=name, model_sha256="", providers="x",
                      config={}, version="0", started_at=t0, finished_at=t0 + timedelta(minutes=10))
            session.add(run)
            session.flush()
            session.add_all(MemorySample(run_id=run.id, at=t0 + timedelta(seconds=s), rss_bytes=200 << 20, fds=10,
                                         threads=10, queue_depth=0, images_done=s,
                                         gpu_bytes=None if gpu(s) is None else int(gpu(s)))
                            for s in range(0, 600, 5))
        session.commit()
    memory = {r["model"]: r["memory"] for r in run_stats(db, last=2, warmup_s=60)}
    db.dispose()
    assert "gpu_peak_mb" not in memory["cpu-run"]
    cuda = memory["cuda-run"]
    assert cuda["gpu_start_mb"] == 500.0 and cuda["gpu_peak_mb"] == cuda["gpu_end_mb"] == 503.3
    assert abs(cuda["gpu_slope_mb_per_h"] - 20) < 0.01
    out = CliRunner().invoke(cli, ["stats", "--db", url, "--last", "2"])
    assert out.exit_code == 0, out.output
    assert out.output.count("GPU memory:") == 1
    assert "GPU memory: 500.0 -> 503.3 MB (peak 503.3), slope 20.0 MB/h after warm-up" in out.output
