"""Host memory for offloaded activations: exactly sized pinned buffers and the per-node budget.

NOTE [Exact pinned host memory]
``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which
rounds every request up to a power of two (a 90 GiB arena pins 128 GiB) and keeps freed blocks
cached for the life of the process. memo's host arena is one large, long-lived buffer sized
from the plan, so it takes plain host memory of exactly the size asked and page-locks that
range with ``cudaHostRegister``; :meth:`PinnedHostBuffer.release` (or the garbage collector)
unlocks it again after the device has finished with it. The memory itself belongs to the
tensor, so a view that outlives the buffer stays valid, only pageable.

NOTE [Host memory is per node]
Every rank of a node pins from the same RAM. torchrun sets ``LOCAL_WORLD_SIZE``; a process may
take at most its share of ``MemTotal`` and never more than ``MemAvailable`` now, so the ranks of
one node together stay within the node however their set-up interleaves.
"""

from __future__ import annotations

import os
import weakref

import torch

from memo.errors import MemoError

__all__ = ["PinnedHostBuffer", "host_memory_limit", "local_world_size", "meminfo_bytes"]

def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``) in bytes, or None where unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_world_size() -> int:
    """Processes of this job on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        raise MemoError(f"memo: LOCAL_WORLD_SIZE must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise MemoError(f"memo: LOCAL_WORLD_SIZE must be a positive integer, got {n}")
    return n


def host_memory_limit() -> int | None:
    """Host bytes this process may pin (NOTE [Host memory is per node]); None where unknown."""
    available, total = meminfo_bytes("MemAvailable"), meminfo_bytes("MemTotal")
    if available is None:
        return None
    share = total // local_world_size() if total is not None else available
    return min(available, share)


def _cudart_check(rc: object, what: str) -> None:
    code = int(getattr(rc, "value", rc))  # the binding returns a cudaError enum
    if code != 0:
        raise MemoError(f"memo: {what} failed with CUDA error {code}")


class PinnedHostBuffer:
    """``nbytes`` of page-locked host memory for copies to and from ``device`` (NOTE [Exact pinned
    host memory]). ``tensor`` is a flat ``uint8`` tensor of exactly ``nbytes``."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < 0:
            raise MemoError(f"memo: a pinned host buffer needs a size >= 0, got {nbytes}")
        self.device = torch.device(device)
        self.nbytes = nbytes
        # The whole storage is registered: torch's is_pinned() asks about the storage's first byte.
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._registered = False
        if nbytes > 0 and self.device.type == "cuda":
            with torch.cuda.device(self.device):
                _cudart_check(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0),
                              f"cudaHostRegister of {nbytes:,} bytes")
            self._registered = True
        self._finalizer = weakref.finalize(self, PinnedHostBuffer._unregister, self.device,
                                           self.tensor.data_ptr(), self._registered)

    @staticmethod
    def _unregister(device: torch.device, ptr: int, registered: bool) -> None:
        if not registered:
            return
        # Copies in flight may still read or write the range: let them finish first.
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(ptr)

    @property
    def pinned(self) -> bool:
        return self._registered

    def release(self) -> None:
        """Unlock the pages now (idempotent); the memory is freed with the last tensor using it."""
        self._finalizer()
