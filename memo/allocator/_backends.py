"""The allocators behind each device type, behind one small interface.

* CPU: ``memo._C.allocator`` (the core compiled into the extension); ``activate`` swaps
  c10's CPU allocator for memo's, ``deactivate`` restores the previous one.
* CUDA: ``memo/_lib/libmemo_cuda.so`` through ctypes (the core compiled into the CUDA
  library); PyTorch allocates through it once :func:`install_cuda` ran, so ``activate``
  only checks that. Outside contexts it behaves as a plain caching allocator.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from memo.allocator._tables import PhaseTables
from memo.errors import MemoError

__all__ = [
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "backend_for",
    "cuda_installed",
    "cuda_library_path",
    "install_cuda",
    "loaded_backends",
]


class Backend(abc.ABC):
    """What :mod:`memo.allocator` needs from a device's planned allocator."""

    device_type: str
    device: torch.device
    """The one device this backend serves (``cuda:N`` for CUDA, every CPU tensor for ``cpu``)."""

    @abc.abstractmethod
    def check_plan(self, tables: PhaseTables, peak: int) -> None:
        """Check the tables as :meth:`load_plan` would, loading nothing (the core's check: NOTE [Plan
        tables are checked in the core] in csrc/core/planned_allocator.h); MemoError with its message."""
    @abc.abstractmethod
    def load_plan(self, tables: PhaseTables, peak: int) -> None: ...
    @abc.abstractmethod
    def unload_plan(self) -> None: ...
    @abc.abstractmethod
    def set_phase(self, name: str | None) -> None: ...
    @abc.abstractmethod
    def suspend_phase(self) -> None: ...
    @abc.abstractmethod
    def resume_phase(self) -> None: ...
    @abc.abstractmethod
    def set_poison(self, on: bool) -> None: ...
    @abc.abstractmethod
    def set_fallback_limit(self, nbytes: int) -> None: ...
    @abc.abstractmethod
    def empty_cache(self) -> int: ...
    @abc.abstractmethod
    def start_logging(self) -> None: ...
    @abc.abstractmethod
    def stop_logging(self) -> tuple[list[tuple[bool, int, int, int]], list[str]]: ...
    @abc.abstractmethod
    def stats(self) -> dict[str, Any]: ...
    @abc.abstractmethod
    def reset_stats(self) -> None: ...
    @abc.abstractmethod
    def take_deviation_report(self) -> dict[str, Any] | None: ...
    def prepare(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Called before a plan is loaded or logging starts (CUDA: install the allocator first)."""

    @abc.abstractmethod
    def activate(self) -> None: ...
    @abc.abstractmethod
    def deactivate(self) -> None: ...


@contextlib.contextmanager
def _as_memo_error() -> Iterator[None]:
    from memo import _C

    try:
        yield
    except _C.allocator.AllocatorError as exc:
        raise MemoError(str(exc)) from exc


class CpuBackend(Backend):
    device_type = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        from memo import _C

        self._mod = _C.allocator
        self._core = _C.allocator.cpu_allocator()

    def check_plan(self, tables: PhaseTables, peak: int) -> None:
        with _as_memo_error():
            self._mod.check_plan(tables, peak)

    def load_plan(self, tables: PhaseTables, peak: int) -> None:
        with _as_memo_error():
            self._core.load_plan(tables, peak)

    def unload_plan(self) -> None:
        self._core.unload_plan()

    def set_phase(self, name: str | None) -> None:
        self._core.set_phase(name)

    def suspend_phase(self) -> None:
        self._core.suspend_phase()

    def resume_phase(self) -> None:
        self._core.resume_phase()

    def set_poison(self, on: bool) -> None:
        self._core.set_poison(on)

    def set_fallback_limit(self, nbytes: int) -> None:
        self._core.set_fallback_limit(nbytes)

    def empty_cache(self) -> int:
        return self._core.empty_cache()

    def start_logging(self) -> None:
        self._core.start_logging()

    def stop_logging(self) -> tuple[list[tuple[bool, int, int, int]], list[str]]:
        return self._core.stop_logging()

    def stats(self) -> dict[str, Any]:
        return self._core.stats()

    def reset_stats(self) -> None:
        self._core.reset_stats()

    def take_deviation_report(self) -> dict[str, Any] | None:
        return self._core.take_deviation_report()

    def activate(self) -> None:
        with _as_memo_error():
            self._mod.install_cpu()

    def deactivate(self) -> None:
        with _as_memo_error():
            self._mod.uninstall_cpu()


def stats_dict(names: list[str], values: Any, first_deviation: dict[str, Any] | None) -> dict[str, Any]:
    """The stats dict from the core's counter names and values (NOTE [Stat names] in
    csrc/core/planned_allocator.h): ``"fallback.x"`` nests as ``out["fallback"]["x"]``."""
    out: dict[str, Any] = {}
    for name, value in zip(names, values, strict=True):
        group, dot, field = name.partition(".")
        if dot:
            out.setdefault(group, {})[field] = int(value)
        else:
            out[name] = int(value)
    out["first_deviation"] = first_deviation
    return out


def cuda_library_path() -> str:
    """Where setup.py puts the CUDA backend library (it may not exist: nvcc absent)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "_lib", "libmemo_cuda.so")


_cuda_lib: ctypes.CDLL | None = None
_cuda_installed = False
_cuda_lock = threading.Lock()


def _load_cuda_library() -> ctypes.CDLL:
    global _cuda_lib
    if _cuda_lib is not None:
        return _cuda_lib
    path = cuda_library_path()
    if not os.path.exists(path):
        raise MemoError(
            f"memo.allocator: the CUDA backend library {path} is missing; rebuild memo with nvcc on PATH "
            "(MEMO_BUILD_CUDA=1 makes a missing nvcc an error)"
        )
    torch_cuda = torch.version.cuda
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:  # typically: the CUDA runtime it links (libcudart.so.N) is not on the loader path
        raise MemoError(
            f"memo.allocator: cannot load the CUDA backend library {path} ({exc}); torch's CUDA is "
            f"{torch_cuda or 'none (CPU-only torch)'}. Rebuild memo against this torch "
            "(pip install --no-build-isolation -e .)"
        ) from exc
    c = ctypes
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "memo_cuda_last_error": (c.c_char_p, []),
        "memo_cuda_runtime_version": (c.c_int, []),
        "memo_cuda_check_plan": (c.c_int, [c.c_int, c.POINTER(c.c_char_p), c.POINTER(c.c_int64),
                                           c.POINTER(c.c_int64), c.POINTER(c.c_int64), c.POINTER(c.c_uint8),
                                           c.c_int64]),
        "memo_cuda_load_plan": (c.c_int, [c.c_int, c.c_int, c.POINTER(c.c_char_p), c.POINTER(c.c_int64),
                                          c.POINTER(c.c_int64), c.POINTER(c.c_int64), c.POINTER(c.c_uint8),
                                          c.c_int64]),
        "memo_cuda_unload_plan": (c.c_int, [c.c_int]),
        "memo_cuda_set_phase": (None, [c.c_char_p]),
        "memo_cuda_suspend_phase": (None, [c.c_int]),
        "memo_cuda_set_poison": (c.c_int, [c.c_int, c.c_int]),
        "memo_cuda_set_fallback_limit": (c.c_int, [c.c_int, c.c_uint64]),
        "memo_cuda_empty_cache": (c.c_uint64, [c.c_int]),
        "memo_cuda_reset_stats": (c.c_int, [c.c_int]),
        "memo_cuda_stat_count": (c.c_int, []),
        "memo_cuda_stat_name": (c.c_char_p, [c.c_int]),
        "memo_cuda_stats": (c.c_int, [c.c_int, c.POINTER(c.c_uint64), c.c_int]),
        "memo_cuda_deviation": (c.c_int, [c.c_int, c.c_int, c.c_char_p, c.c_int, c.POINTER(c.c_int64),
                                          c.POINTER(c.c_uint64), c.POINTER(c.c_uint64), c.c_char_p, c.c_int]),
        "memo_cuda_start_logging": (c.c_int, [c.c_int]),
        "memo_cuda_stop_logging": (c.c_int64, [c.c_int]),
        "memo_cuda_read_log": (c.c_int64, [c.POINTER(c.c_uint8), c.POINTER(c.c_uint64), c.POINTER(c.c_uint64),
                                           c.POINTER(c.c_int32), c.c_int64]),
        "memo_cuda_log_phase_count": (c.c_int, []),
        "memo_cuda_log_phase_name": (c.c_char_p, [c.c_int]),
    }
    for name, (restype, argtypes) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:  # a library from an older memo build
            raise MemoError(
                f"memo.allocator: the CUDA backend library {path} lacks {name}: it is from another memo "
                "build. Rebuild memo against this torch (pip install --no-build-isolation -e .)"
            ) from exc
        fn.restype = restype
        fn.argtypes = argtypes
    # The library and torch must share one CUDA runtime (streams, events and memory are per runtime).
    # A CPU-only torch has none: loading is then only a link check, and nothing is compared.
    if torch_cuda is not None:
        runtime = int(lib.memo_cuda_runtime_version())
        lib_major = runtime // 1000
        if runtime < 0 or str(lib_major) != torch_cuda.split(".")[0]:
            lib_version = "unknown" if runtime < 0 else f"{lib_major}.{runtime % 1000 // 10}"
            raise MemoError(
                f"memo.allocator: the CUDA backend library {path} uses CUDA runtime {lib_version}, but "
                f"this torch ({torch.__version__}) was built with CUDA {torch_cuda}; the major versions must "
                "match. Rebuild memo against this torch (pip install --no-build-isolation -e .)"
            )
    _cuda_lib = lib
    return lib


def _plan_arrays(tables: PhaseTables) -> tuple[Any, ...]:
    """The tables in the CUDA C API's flat shape: (n_phases, names, counts, sizes, offsets, planned).
    Values pass through unchecked: the core checks them (memo_cuda_check_plan / memo_cuda_load_plan)."""
    names = list(tables)
    counts = [len(tables[n]) for n in names]
    sizes = [s for n in names for s, _ in tables[n]]
    offsets = [0 if o is None else o for n in names for _, o in tables[n]]
    planned = [0 if o is None else 1 for n in names for _, o in tables[n]]
    c = ctypes
    return (len(names), (c.c_char_p * len(names))(*[n.encode() for n in names]),
            (c.c_int64 * len(counts))(*counts), (c.c_int64 * len(sizes))(*sizes),
            (c.c_int64 * len(offsets))(*offsets), (c.c_uint8 * len(planned))(*planned))


def cuda_stat_names(lib: ctypes.CDLL) -> list[str]:
    """The counter names the CUDA library reports, in the order ``memo_cuda_stats`` writes them."""
    return [lib.memo_cuda_stat_name(i).decode() for i in range(lib.memo_cuda_stat_count())]


def cuda_installed() -> bool:
    """Whether PyTorch's CUDA allocations go through memo's CUDA backend."""
    return _cuda_installed


def install_cuda() -> None:
    """Make memo's CUDA backend PyTorch's CUDA allocator, for the rest of the process.

    PyTorch allows this only before its CUDA state (and caching allocator) is initialised, i.e.
    before the first CUDA tensor: call it at the top of the training script. Raises
    :class:`~memo.errors.MemoError` when it is too late.
    """
    global _cuda_installed
    with _cuda_lock:
        if _cuda_installed:
            return
        lib_path = cuda_library_path()
        _load_cuda_library()
        if torch.cuda.is_initialized():
            raise MemoError(
                "memo.allocator: too late to install memo's CUDA allocator: PyTorch's CUDA state (and its "
                "caching allocator) is already initialised. Call memo.allocator.install_cuda() (or enter "
                "memo.allocator.planned(..., device='cuda')) before the first CUDA tensor is created."
            )
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "memo_malloc", "memo_free")
        try:
            torch.cuda.memory.change_current_allocator(pluggable)
        except RuntimeError as exc:
            raise MemoError(f"memo.allocator: PyTorch refused memo's CUDA allocator: {exc}") from exc
        _cuda_installed = True


class CudaBackend(Backend):
    device_type = "cuda"

    def __init__(self, index: int) -> None:
        self._lib = _load_cuda_library()
        self._dev = index
        self.device = torch.device("cuda", index)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = (self._lib.memo_cuda_last_error() or b"").decode()
            raise MemoError(msg or f"memo.allocator: {what} failed on cuda:{self._dev}")

    def check_plan(self, tables: PhaseTables, peak: int) -> None:
        self._check(self._lib.memo_cuda_check_plan(*_plan_arrays(tables), peak), "checking the plan")

    def load_plan(self, tables: PhaseTables, peak: int) -> None:
        self._check(self._lib.memo_cuda_load_plan(self._dev, *_plan_arrays(tables), peak), "loading the plan")

    def unload_plan(self) -> None:
        self._check(self._lib.memo_cuda_unload_plan(self._dev), "unloading the plan")

    def set_phase(self, name: str | None) -> None:
        self._lib.memo_cuda_set_phase(None if name is None else name.encode())

    # The CUDA library keeps the phase process-wide, like set_phase: one call reaches every device.
    def suspend_phase(self) -> None:
        self._lib.memo_cuda_suspend_phase(1)

    def resume_phase(self) -> None:
        self._lib.memo_cuda_suspend_phase(0)

    def set_poison(self, on: bool) -> None:
        self._check(self._lib.memo_cuda_set_poison(self._dev, int(on)), "set_poison")

    def set_fallback_limit(self, nbytes: int) -> None:
        self._check(self._lib.memo_cuda_set_fallback_limit(self._dev, nbytes), "set_fallback_limit")

    def empty_cache(self) -> int:
        return int(self._lib.memo_cuda_empty_cache(self._dev))

    def start_logging(self) -> None:
        self._check(self._lib.memo_cuda_start_logging(self._dev), "start_logging")

    def stop_logging(self) -> tuple[list[tuple[bool, int, int, int]], list[str]]:
        n = int(self._lib.memo_cuda_stop_logging(self._dev))
        c = ctypes
        ism, ids, sizes, phases = (c.c_uint8 * n)(), (c.c_uint64 * n)(), (c.c_uint64 * n)(), (c.c_int32 * n)()
        self._lib.memo_cuda_read_log(ism, ids, sizes, phases, n)
        n_names = self._lib.memo_cuda_log_phase_count()
        names = [self._lib.memo_cuda_log_phase_name(i).decode() for i in range(n_names)]
        return [(bool(ism[i]), ids[i], sizes[i], phases[i]) for i in range(n)], names

    def _deviation(self, take: bool) -> dict[str, Any] | None:
        phase, reason = ctypes.create_string_buffer(256), ctypes.create_string_buffer(64)
        index, expected, actual = ctypes.c_int64(), ctypes.c_uint64(), ctypes.c_uint64()
        got = self._lib.memo_cuda_deviation(self._dev, int(take), phase, 256, ctypes.byref(index),
                                            ctypes.byref(expected), ctypes.byref(actual), reason, 64)
        if not got:
            return None
        return {"phase": phase.value.decode(), "index": index.value, "expected": expected.value,
                "actual": actual.value, "reason": reason.value.decode()}

    def stats(self) -> dict[str, Any]:
        names = cuda_stat_names(self._lib)
        buf = (ctypes.c_uint64 * len(names))()
        self._check(0 if self._lib.memo_cuda_stats(self._dev, buf, len(buf)) == len(buf) else -1, "stats")
        return stats_dict(names, buf, self._deviation(take=False))

    def reset_stats(self) -> None:
        self._check(self._lib.memo_cuda_reset_stats(self._dev), "reset_stats")

    def take_deviation_report(self) -> dict[str, Any] | None:
        return self._deviation(take=True)

    def prepare(self) -> None:
        install_cuda()  # before our first cudaMalloc, so the "too late" check sees torch's state only

    def activate(self) -> None:
        install_cuda()

    def deactivate(self) -> None:
        """The CUDA allocator stays installed; without a plan it is a plain caching allocator."""


_backends: dict[tuple[str, int], Backend] = {}


def backend_for(device: str | torch.device) -> Backend:
    """The backend serving ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a torch.device)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MemoError(f"memo.allocator: {device!r} is not a device") from exc
    if dev.type == "cpu":
        key = ("cpu", 0)
        if key not in _backends:
            _backends[key] = CpuBackend()
    elif dev.type == "cuda":
        # "cuda" means the current device, as it does for torch.empty(device="cuda").
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        key = ("cuda", index)
        if key not in _backends:
            _backends[key] = CudaBackend(index)
    else:
        raise MemoError(
            f"memo.allocator: device type {dev.type!r} has no memo allocator; use 'cpu' or 'cuda'"
        )
    return _backends[key]


def loaded_backends() -> list[Backend]:
    """Backends created so far (the ones :func:`memo.allocator.set_phase` must reach)."""
    if not _backends:
        backend_for("cpu")
    return list(_backends.values())
