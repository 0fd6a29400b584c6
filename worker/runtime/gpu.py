"""What the process can learn about its GPU: which onnxruntime build is installed, and how much GPU
memory it holds (through NVML, the `gpu` extra's nvidia-ml-py; the driver ships libnvidia-ml).

On CPU the build check finds the one build and no GpuMemory is made.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

# distributions that install the `onnxruntime` module: pip treats them as different packages, so
# two of them in one environment overwrite each other's files and the result is whichever came last
ONNXRUNTIME_BUILDS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino",
                      "onnxruntime-qnn", "onnxruntime-rocm", "onnxruntime-silicon")


@functools.cache  # the environment does not change while the process runs; each Engine asks
def installed_onnxruntime_builds() -> tuple[str, ...]:
    """The onnxruntime distributions installed in this environment (normally exactly one)."""
    found = []
    for name in ONNXRUNTIME_BUILDS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return tuple(found)


def conflicting_builds(builds: Sequence[str]) -> str | None:
    """A warning when more than one onnxruntime build is installed, else None."""
    if len(builds) < 2:
        return None
    keep = next((b for b in builds if b != "onnxruntime"), builds[-1])
    return (f"{', '.join(builds)} are installed together; they share the module 'onnxruntime', so which one runs "
            f"depends on the order they were installed in. Keep one: pip uninstall -y {' '.join(builds)} "
            f"&& pip install {keep}")


def _driver_library() -> str:
    return "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"


def _provider_library(which: str) -> Path:
    """onnxruntime's provider library `which` (cuda, shared) in the installed build."""
    import onnxruntime as ort

    name = f"onnxruntime_providers_{which}.dll" if os.name == "nt" else f"libonnxruntime_providers_{which}.so"
    return Path(ort.__file__).parent / "capi" / name


@functools.cache  # asked by every Engine; the machine does not change while the process runs
def cuda_missing(available: tuple[str, ...]) -> str | None:
    """Why CUDA surely cannot run here, in a few words, or None when it may: the build has no CUDA provider,
    or the machine has no NVIDIA driver. Asked before a session is made, because onnxruntime itself would
    print a multi-line load error, then run on the CPU anyway."""
    if "CUDAExecutionProvider" not in available:
        return "this onnxruntime build has no CUDA provider: pip install onnxruntime-gpu"
    try:
        ctypes.CDLL(_driver_library())
    except OSError:
        return f"no NVIDIA driver: {_driver_library()} not found"
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21: the nvidia-* wheels' libraries, without LD_LIBRARY_PATH
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                ort.preload_dlls()
        except Exception as e:
            log.debug("onnxruntime.preload_dlls: %s", e)
    return None


def cuda_libraries_missing() -> str | None:
    """Where a driver is there but CUDA did not start: which of CUDA's or cuDNN's libraries does not load, said
    the way onnxruntime loads its CUDA provider (after its shared provider library, loaded globally)."""
    try:
        ctypes.CDLL(str(_provider_library("shared")), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(_provider_library("cuda")))
    except OSError as e:  # "libcublasLt.so.13: cannot open shared object file": the first library missing
        missing = str(e).split(":")[0].strip() if "cannot open" in str(e) else str(e)
        return f"CUDA's libraries do not load ({missing}): pip install -e '.[cuda]' adds them"
    return None


def nvml_index(device_id: int, visible: str | None) -> int | str:
    """The NVML index (or UUID) of CUDA device `device_id` under CUDA_VISIBLE_DEVICES=`visible`.

    CUDA numbers only the visible devices, NVML numbers all of them: with CUDA_VISIBLE_DEVICES=2,3,
    CUDA device 0 is NVML device 2."""
    if not visible:
        return device_id
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if device_id >= len(entries):
        return device_id
    entry = entries[device_id]
    return int(entry) if entry.isdigit() else entry  # a UUID ("GPU-...") or MIG id


class GpuMemory:
    """Bytes of GPU memory this process holds on one CUDA device, read through NVML.

    Calling it answers None when NVML (nvidia-ml-py and the driver's libnvidia-ml) is missing or
    the device cannot be found. Where NVML does not list this process (a container with its own PID
    namespace), it answers the memory used on the whole device and says so once in the log."""

    def __init__(self, device_id: int, nvml: Any = None) -> None:
        self._nvml = nvml if nvml is not None else _load_nvml()
        self._handle: Any = None
        self._whole_device_noted = False
        if self._nvml is None:
            log.info("GPU memory is not recorded: NVML's Python bindings are missing (pip install nvidia-ml-py, "
                     "or the package's gpu extra)")
            return
        index = nvml_index(device_id, os.environ.get("CUDA_VISIBLE_DEVICES"))
        try:
            self._nvml.nvmlInit()
            self._handle = (self._nvml.nvmlDeviceGetHandleByIndex(index) if isinstance(index, int)
                            else self._nvml.nvmlDeviceGetHandleByUUID(index))
        except Exception as e:  # no driver, no such device: GPU memory is just not recorded
            log.warning("GPU memory will not be recorded: NVML cannot open CUDA device %s: %s", device_id, e)
            self._handle = None

    def __call__(self) -> int | None:
        if self._handle is None:
            return None
        try:
            pid = os.getpid()
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
            if not self._whole_device_noted:
                log.info("NVML does not list this process (PID namespace?): recording the whole device's "
                         "used GPU memory instead")
                self._whole_device_noted = True
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except Exception:  # a driver hiccup must not stop the sampler
            return None


def _load_nvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml
