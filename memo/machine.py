"""The machine a job runs on, as the alpha LP, the layer policy and the device budget see it.

NOTE [One machine description]
``memo profile``, ``memo train``, ``memo estimate``, the pipeline and the strategies all need the
same handful of numbers: the host<->device link, one layer's forward time, the node's host memory
and how many processes share it, and the device budget. They are one :class:`Machine`; a field
left ``None`` is measured where the job runs (the pipeline) or assumed (``memo estimate``, which
fills its own defaults with :meth:`Machine.with_defaults`). Torch-free: the CLI builds one before
anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memo.errors import MemoError
from memo.units import GB

if TYPE_CHECKING:
    import argparse

__all__ = ["GB", "Machine"]



def _positive(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


@dataclass(frozen=True)
class Machine:
    """One GPU (rank) of a node, and the node around it. ``None``: measured, or unknown."""

    bandwidth_gbps: float | None = None
    """Host<->device copy bandwidth B of one GPU in GB/s (10^9 B/s)."""
    layer_ms: float | None = None
    """Forward time T_layer of one layer in ms, for the job's sequence on one rank."""
    gpu: str | None = None
    """GPU whose peak FLOP/s estimate T_layer when ``layer_ms`` is None (h100, a100, ...)."""
    efficiency: float = 0.5
    """Share of ``gpu``'s peak a layer's forward reaches, for that estimate."""
    host_mem_gb: float | None = None
    """Host memory of the node in GB."""
    gpus_per_node: int | None = None
    """Processes (GPUs) per node sharing its host memory (None: one)."""
    host_safety: float = 0.8
    """Share of a process's part of the host memory memo may pin."""
    device_mem_gb: float | None = None
    """Memory of one GPU in GB: the per-rank device budget, model states included."""
    # memo estimate's own numbers (NOTE [One machine description]):
    fit_fraction: float = 0.8
    """Share of ``device_mem_gb`` an estimate may fill and still "fit" (the seed's 80% rule)."""
    layer_ms_at: tuple[int, int] | None = None
    """(sequence length, t·c ranks) ``layer_ms`` was given for; memo estimate scales it to others."""
    memo_keep_last: int = 0
    """Layers at the end of a pipeline stage that memo keeps whole: 0 (memo's leanest policy) or 2
    (the paper's fixed rule: their backward follows at once)."""

    def __post_init__(self) -> None:
        for name, flag, unit in (("bandwidth_gbps", "--bandwidth-gbps", "GB/s"),
                                 ("layer_ms", "--layer-ms", "ms"), ("host_mem_gb", "--host-mem-gb", "GB")):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise MemoError(f"memo.machine: {flag} must be a positive number of {unit}, got {value!r}")
        if self.device_mem_gb is not None and not _positive(self.device_mem_gb):
            raise MemoError("memo.profiler: the device memory (--device-mem-gb) must be a positive number of "
                            f"GB, got {self.device_mem_gb!r}")
        if not (_positive(self.efficiency) and self.efficiency <= 1):
            raise MemoError(f"memo.machine: --efficiency must be in (0, 1], got {self.efficiency!r}")
        gpus = self.gpus_per_node
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
            raise MemoError(f"memo.machine: --gpus-per-node must be an integer >= 1, got {gpus!r}")
        if not (_positive(self.host_safety) and self.host_safety <= 1):
            raise MemoError(f"memo.machine: --host-safety must be in (0, 1], got {self.host_safety!r}")
        if not (_positive(self.fit_fraction) and self.fit_fraction <= 1):
            raise MemoError(f"memo.machine: --fit-fraction must be in (0, 1], got {self.fit_fraction!r}")
        if self.memo_keep_last not in (0, 2):
            raise MemoError(f"memo.machine: --memo-keep-last must be 0 or 2, got {self.memo_keep_last!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> Machine:
        """The machine flags of ``memo.cli.args.add_machine_arguments`` (missing ones keep defaults)."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if getattr(args, f.name, None) is not None}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def with_defaults(self, **defaults: Any) -> Machine:
        """This machine with its ``None`` fields set from ``defaults``."""
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def replace(self, **changes: Any) -> Machine:
        return dataclasses.replace(self, **changes)

    @property
    def processes_per_node(self) -> int:
        """``gpus_per_node``, one when not given."""
        return 1 if self.gpus_per_node is None else int(self.gpus_per_node)

    @property
    def limit_bytes(self) -> int:
        """The bytes an estimate may fill on one GPU: ``fit_fraction`` of ``device_mem_gb``."""
        if self.device_mem_gb is None:
            raise MemoError("memo.machine: the device memory is not known; give --device-mem-gb")
        return int(self.device_mem_gb * GB * self.fit_fraction)

    @property
    def device_budget_bytes(self) -> int | None:
        """``device_mem_gb`` in bytes (None: no budget)."""
        return None if self.device_mem_gb is None else int(self.device_mem_gb * GB)

    def host_per_process(self, host_bytes: int | None = None) -> int:
        """Bytes one process may pin: the node's host memory (``host_bytes``, else ``host_mem_gb``)
        shared by ``gpus_per_node``, times ``host_safety`` (the planner's rule)."""
        from memo.planner import host_memory_per_process

        if host_bytes is None:
            if self.host_mem_gb is None:
                raise MemoError("memo.machine: the host memory is not known; give --host-mem-gb")
            host_bytes = int(self.host_mem_gb * GB)
        return host_memory_per_process(int(host_bytes), self.processes_per_node, self.host_safety)
