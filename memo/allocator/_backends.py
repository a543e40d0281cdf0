"""The allocators behind each device type, behind one class.

Every native allocator is reached through one binding, ``memo._C.allocator``, over the allocator's
C API (NOTE [One allocator C API] in csrc/core/allocator_api.h): :class:`Backend` wraps one of its
allocators, whichever backend is behind it. What differs per device type is how PyTorch is routed
through it:

* CPU: the C API of ``memo._C`` itself; ``activate`` swaps c10's CPU allocator for memo's,
  ``deactivate`` restores the previous one.
* CUDA: the C API of ``memo/_lib/libmemo_cuda.so``; PyTorch allocates through it once
  :func:`install_cuda` ran, so ``activate`` only checks that. Outside contexts it behaves as a
  plain caching allocator.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from memo.allocator._tables import PhaseTables
from memo.errors import MemoError

if TYPE_CHECKING:
    from memo import _C

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


def _binding() -> ModuleType:
    """``memo._C.allocator``, imported on first use: importing memo.allocator needs no extension."""
    from memo import _C

    return _C.allocator


@contextlib.contextmanager
def _as_memo_error() -> Iterator[None]:
    try:
        yield
    except _binding().AllocatorError as exc:
        raise MemoError(str(exc)) from exc


class Backend:
    """What :mod:`memo.allocator` needs from a device's planned allocator: one allocator of the C API,
    reached through ``memo._C.allocator``. The subclasses route PyTorch through it."""

    device_type: str
    device: torch.device
    """The one device this backend serves (``cuda:N`` for CUDA, every CPU tensor for ``cpu``)."""

    def __init__(self, library: _C.allocator.Library, index: int) -> None:
        self._library = library
        with _as_memo_error():
            self._native = library.device_allocator(self.device_type, index)

    def check_plan(self, tables: PhaseTables, peak: int) -> None:
        """Check the tables as :meth:`load_plan` would, loading nothing (the core's check: NOTE [Plan
        tables are checked in the core] in csrc/core/planned_allocator.h); MemoError with its message."""
        with _as_memo_error():
            self._library.check_plan(tables, peak)

    def load_plan(self, tables: PhaseTables, peak: int) -> None:
        with _as_memo_error():
            self._native.load_plan(tables, peak)

    def unload_plan(self) -> None:
        with _as_memo_error():
            self._native.unload_plan()

    # On a device allocator the phase is process-wide: one call reaches every device of the backend.
    def set_phase(self, name: str | None) -> None:
        with _as_memo_error():
            self._native.set_phase(name)

    def suspend_phase(self) -> None:
        with _as_memo_error():
            self._native.suspend_phase()

    def resume_phase(self) -> None:
        with _as_memo_error():
            self._native.resume_phase()

    def set_poison(self, on: bool) -> None:
        with _as_memo_error():
            self._native.set_poison(on)

    def set_fallback_limit(self, nbytes: int) -> None:
        with _as_memo_error():
            self._native.set_fallback_limit(nbytes)

    def empty_cache(self) -> int:
        return self._native.empty_cache()

    def start_logging(self) -> None:
        with _as_memo_error():
            self._native.start_logging()

    def stop_logging(self) -> tuple[list[tuple[bool, int, int, int]], list[str]]:
        with _as_memo_error():
            return self._native.stop_logging()

    def stats(self) -> dict[str, Any]:
        with _as_memo_error():
            return self._native.stats()

    def reset_stats(self) -> None:
        with _as_memo_error():
            self._native.reset_stats()

    def take_deviation_report(self) -> dict[str, Any] | None:
        return self._native.take_deviation_report()

    def prepare(self) -> None:
        """Called before a plan is loaded or logging starts (CUDA: install the allocator first)."""

    def activate(self) -> None:
        """Route PyTorch's allocations of :attr:`device` through this allocator."""

    def deactivate(self) -> None:
        """Undo :meth:`activate`."""


class CpuBackend(Backend):
    device_type = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        super().__init__(_binding().library(), 0)

    def activate(self) -> None:
        with _as_memo_error():
            _binding().install_cpu()

    def deactivate(self) -> None:
        with _as_memo_error():
            _binding().uninstall_cpu()


def cuda_library_path() -> str:
    """Where setup.py puts the CUDA backend library (it may not exist: nvcc absent)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "_lib", "libmemo_cuda.so")


_cuda_lib: _C.allocator.Library | None = None
_cuda_installed = False
_cuda_lock = threading.Lock()

_REBUILD = "Rebuild memo against this torch (pip install --no-build-isolation -e .)"


def _load_cuda_library() -> _C.allocator.Library:
    """The CUDA backend library's C API, through memo's one binding; loaded once."""
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
        lib = _binding().load_library(path)
    except OSError as exc:  # typically: the CUDA runtime it links (libcudart.so.N) is not on the loader path
        raise MemoError(
            f"memo.allocator: cannot load the CUDA backend library {path} ({exc}); torch's CUDA is "
            f"{torch_cuda or 'none (CPU-only torch)'}. {_REBUILD}"
        ) from exc
    except _binding().AllocatorError as exc:  # a library from an older memo build: it lacks a function
        raise MemoError(f"memo.allocator: the CUDA backend library {path} is not this memo's ({exc}). "
                        f"{_REBUILD}") from exc
    # The library and torch must share one CUDA runtime (streams, events and memory are per runtime).
    # A CPU-only torch has none: loading is then only a link check, and nothing is compared.
    if torch_cuda is not None:
        runtime = lib.runtime_version("cuda")
        lib_major = runtime // 1000
        if runtime < 0 or str(lib_major) != torch_cuda.split(".")[0]:
            lib_version = "unknown" if runtime < 0 else f"{lib_major}.{runtime % 1000 // 10}"
            raise MemoError(
                f"memo.allocator: the CUDA backend library {path} uses CUDA runtime {lib_version}, but "
                f"this torch ({torch.__version__}) was built with CUDA {torch_cuda}; the major versions must "
                f"match. {_REBUILD}"
            )
    _cuda_lib = lib
    return lib


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
        super().__init__(_load_cuda_library(), index)
        self.device = torch.device("cuda", index)

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
