"""The least memory a run needs, checked before any work.

NOTE [Least memory, checked first]
A sequence the machine cannot hold is refused before any work; found out late, ``memo profile
--device cpu --seq-len 1000000000`` on the tiny model records for over a minute on meta before the
real model fails to allocate, and ``memo train`` dies in PyTorch's allocator with a traceback. Two
things are on the device that runs the model at the same instant under every strategy (offload,
recompute, a plan), and their sizes are known from the shapes alone:

* the parameters: exact, from the model built on meta (GPT's position table grows with the
  sequence);
* one layer's input, ``micro_batch x seq_len / (c·t) x hidden`` elements of the parameters'
  dtype (NOTE [Per-rank sizes]), which the embedding writes before layer 0 runs.

Their sum is a lower bound of the run's need on that device: nothing memo does makes either
smaller. :func:`check_least_memory` refuses a run whose bound exceeds what the device can ever
have (cpu: the machine's RAM and swap; cuda: the GPU's memory) or the ``--device-mem-gb``
budget, in under a second and with the numbers. A run it lets through may still not fit; the
policy, the runtime or the allocator then refuse it with its full need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memo.errors import MemoError
from memo.units import format_bytes

__all__ = ["LeastMemory", "check_least_memory", "least_memory"]


@dataclass(frozen=True)
class LeastMemory:
    """A lower bound of one rank's memory on the device that runs the model.

    Attributes:
        parameters: bytes of the parameters (one tensor-parallel rank's).
        layer_input: bytes of one layer's input (0 when the hidden size is not known).
        tokens: tokens of the sequence the layer input holds (``seq_len / (c·t)``).
        micro_batch, hidden, itemsize: the layer input's other dimensions.
    """

    parameters: int
    layer_input: int
    tokens: int
    micro_batch: int
    hidden: int | None
    itemsize: int

    @property
    def total(self) -> int:
        return self.parameters + self.layer_input


def least_memory(model: nn.Module, tokens: int, micro_batch: int) -> LeastMemory:
    """The bound for ``model`` (any device, meta included) running ``micro_batch`` sequences whose
    layer input holds ``tokens`` tokens (NOTE [Least memory, checked first])."""
    params = list(model.parameters())  # tied parameters are listed once
    itemsize = params[0].element_size() if params else 2
    hidden = getattr(getattr(model, "config", None), "hidden", None)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        hidden = None  # a model without memo's config: its parameters alone
    from memo.profiler.device import local_tensor  # a rank's shard under FSDP2 (NOTE [Model states])

    return LeastMemory(parameters=sum(local_tensor(p).numel() * p.element_size() for p in params),
                       layer_input=micro_batch * tokens * hidden * itemsize if hidden else 0,
                       tokens=tokens, micro_batch=micro_batch, hidden=hidden, itemsize=itemsize)


def _meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes; None where it cannot be read."""
    from memo.allocator.host import meminfo_bytes

    return meminfo_bytes(field)


def device_capacity(device: torch.device) -> tuple[int, str] | None:
    """The most memory ``device`` can ever give one process, and what it is; None when unknown
    (meta). For cpu that is RAM plus swap: generous on purpose, the bound must never refuse a run
    that would fit."""
    if device.type == "cpu":
        ram, swap = _meminfo("MemTotal"), _meminfo("SwapTotal")
        if ram is None:
            return None
        return ram + (swap or 0), "this machine's memory (RAM + swap)"
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory), f"the memory of {device}"
    return None


def check_least_memory(least: LeastMemory, device: torch.device, budget_bytes: int | None, what: str,
                       seq_len: int) -> None:
    """Raise a :class:`MemoError` naming ``what`` (e.g. ``"memo.profiler"``) when ``least`` exceeds
    the ``device_mem_gb`` budget or what ``device`` can ever have (NOTE [Least memory, checked
    first]); ``seq_len`` is the job's whole sequence, for the message."""
    limits = [] if budget_bytes is None else [(budget_bytes,
                                               f"the --device-mem-gb {budget_bytes / 1e9:g} budget")]
    capacity = device_capacity(device)
    if capacity is not None:
        limits.append(capacity)
    if not limits:
        return
    limit, name = min(limits)
    if least.total <= limit:
        return
    parts = f"the parameters, {format_bytes(least.parameters)}"
    if least.layer_input:
        parts += (f", and one layer's input, {least.micro_batch} x {least.tokens:,} tokens x hidden "
                  f"{least.hidden} x {least.itemsize} bytes = {format_bytes(least.layer_input)}")
    raise MemoError(
        f"{what}: --seq-len {seq_len:,} needs at least {format_bytes(least.total)} "
        f"{'per device' if device.type == 'meta' else f'on {device}'} ({parts}), "
        f"more than {name}, {format_bytes(limit)}; nothing was run. Use a shorter --seq-len or a "
        "smaller --micro-batch"
    )
