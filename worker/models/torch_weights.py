"""Read a PyPI-shipped PyTorch state_dict into numpy arrays without PyTorch and without trusting it.

Both of PyTorch's formats are handled: the zip archive (torch >= 1.6) and the legacy stream (magic
number, protocol, sys info, the pickled dict, the storage keys, then raw storages). The pickles
are read by a restricted unpickler that resolves only the callables needed to rebuild tensors and
an OrderedDict; any other global (os.system, builtins.eval, ...) is refused.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from worker.errors import ModelError

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = np.dtype(_DTYPES[name])


class _Storage:
    """A flat numpy buffer standing in for a torch storage (filled later in the legacy format)."""

    def __init__(self, dtype: np.dtype, numel: int, data: np.ndarray | None = None) -> None:
        self.dtype = dtype
        self.array = data if data is not None else np.zeros(numel, dtype=dtype)


def _rebuild_tensor_v2(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                       *_ignored: Any) -> "_LazyTensor":
    return _LazyTensor(storage, offset, tuple(size), tuple(stride))


class _LazyTensor:
    """Resolved to a numpy array once the storages are filled (legacy format stores data last)."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def numpy(self) -> np.ndarray:
        arr = self.storage.array
        item = arr.dtype.itemsize
        if not self.size:
            return np.array(arr[self.offset])
        view = np.lib.stride_tricks.as_strided(arr[self.offset:], shape=self.size,
                                               strides=[s * item for s in self.stride])
        return np.array(view)


def _rebuild_parameter(data: Any, *_ignored: Any) -> Any:
    return data


_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
}


class _Restricted(pickle.Unpickler):
    def __init__(self, f: io.BufferedIOBase, load_storage: Callable[[tuple[Any, ...]], _Storage]) -> None:
        super().__init__(f)
        self._load_storage = load_storage

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _DTYPES:
            return _StorageType(name)
        raise pickle.UnpicklingError(f"refusing global {module}.{name} in a downloaded weight file")

    def persistent_load(self, pid: Any) -> Any:
        return self._load_storage(tuple(pid))


def load_state_dict(path: Path) -> dict[str, np.ndarray]:
    """Parameter name -> numpy array."""
    try:
        if zipfile.is_zipfile(path):
            raw = _load_zip(path)
        else:
            raw = _load_legacy(path)
    except (pickle.UnpicklingError, KeyError, ValueError, struct.error, EOFError) as e:
        raise ModelError(f"{path}: not a readable PyTorch state_dict: {e}") from None
    if isinstance(raw, dict) and "state_dict" in raw:
        raw = raw["state_dict"]
    return {k: v.numpy() for k, v in raw.items() if isinstance(v, _LazyTensor)}


def _load_zip(path: Path) -> Any:
    with zipfile.ZipFile(path) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
        prefix = pkl[: -len("data.pkl")]

        def storage(pid: tuple[Any, ...]) -> _Storage:
            _, stype, key, _location, numel = pid[:5]
            data = np.frombuffer(zf.read(f"{prefix}data/{key}"), dtype=stype.dtype)
            return _Storage(stype.dtype, numel, data)

        return _Restricted(io.BytesIO(zf.read(pkl)), storage).load()  # type: ignore[arg-type]


def _load_legacy(path: Path) -> Any:
    with path.open("rb") as f:
        safe = _Restricted(f, lambda pid: _Storage(np.dtype(np.uint8), 0))  # type: ignore[arg-type]
        if safe.load() != LEGACY_MAGIC:
            raise ValueError("not a PyTorch file (bad magic number)")
        safe.load()  # protocol version
        safe.load()  # sys info: little endian, type sizes
        storages: dict[str, _Storage] = {}

        def storage(pid: tuple[Any, ...]) -> _Storage:
            _, stype, key, _location, numel = pid[:5]
            if key not in storages:
                storages[key] = _Storage(stype.dtype, numel)
            return storages[key]

        result = _Restricted(f, storage).load()  # type: ignore[arg-type]
        keys = _Restricted(f, storage).load()  # type: ignore[arg-type]
        for key in keys:
            s = storages[key]
            (numel,) = struct.unpack("<q", f.read(8))
            s.array = np.frombuffer(f.read(numel * s.dtype.itemsize), dtype=s.dtype).copy()
    return result
