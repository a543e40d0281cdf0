"""What one run of the pipeline works on: the arguments of :func:`memo.pipeline.profile`, resolved
(``_Job``), and the model and example batch it builds when given a name."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.adapters.model import model_adapter_for
from memo.machine import Machine

from .device import _iteration_total

if TYPE_CHECKING:
    from .passes import ProbeKey, WrappedRun

__all__ = ["build_profile_model", "example_batch"]


def build_profile_model(name: str, seq_len: int, dtype: torch.dtype, device: torch.device,
                        tensor_parallel: int = 1) -> nn.Module:
    """Build a registered reference model able to run ``seq_len`` tokens on ``device``, as one rank of
    a ``tensor_parallel``-way Megatron tensor + sequence parallel group (NOTE [Tensor-parallel rank]
    in memo/models/parallel.py).

    ``seq_len`` is the job's whole sequence, also under context parallelism: a context-parallel rank
    runs fewer tokens but holds the same parameters (GPT's position table covers every position;
    NOTE [Context-parallel profile])."""
    from memo.models import DEFAULT_MAX_SEQ_LEN, build_model, get_config

    config = get_config(name)
    # GPT's learned position table bounds the length (NOTE [GPT position table] in memo.models.model).
    # Size it as training does (memo.train.loop), so the profiled requests are the ones a
    # training step makes: the table's gradient is one of them.
    kw = {"max_seq_len": max(seq_len, DEFAULT_MAX_SEQ_LEN)} if config.arch == "gpt" else {}
    return build_model(config, device=device, dtype=dtype, tensor_parallel=tensor_parallel, **kw)


def example_batch(model: nn.Module, seq_len: int, micro_batch: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``ids, labels: [micro_batch, seq_len]`` in the model's vocabulary (zeros on meta)."""
    if device.type == "meta":
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        return ids, ids
    vocab = model_adapter_for(model, "memo.profiler").vocab_size(model)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    labels = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    return ids, labels


@dataclass
class _Job:
    """What one run of the pipeline works on (the arguments of :func:`profile`, resolved)."""

    net: nn.Module | None  # the model on its device (None until a named model is built there)
    source: str | None  # a registered name or CONFIG.json when memo builds the model
    name: str
    device: torch.device
    dtype: torch.dtype
    seq_len: int  # tokens one context-parallel rank runs (NOTE [Context-parallel profile])
    job_seq_len: int  # the job's whole sequence
    micro_batch: int
    tp: int
    cp: int
    machine: Machine
    recorder: str
    progress: bool
    say: Callable[[str], None]
    meta: dict[str, Any] = field(default_factory=dict)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: The largest of a number over the ranks profiling together (NOTE [Decisions every rank shares]).
    agree_max: Callable[[int], int] = int
    #: The last wrapped iteration a policy probe recorded, by (alpha, policy, tile): pass 2 of the
    #: same choice takes it instead of recording it again (NOTE [Pass 2 is the last probe]).
    last_probe: tuple[ProbeKey, dict[str, Any], WrappedRun] | None = None

    def recorded_total(self, trace: dict[str, Any], static: int) -> int:
        """:func:`_iteration_total` of a recorded iteration, the same on every rank."""
        return self.agree_max(_iteration_total(trace, static))

    def built(self) -> nn.Module:
        """The model on its device, built there the first time for a model given by name."""
        if self.net is None:
            t0 = time.perf_counter()
            assert self.source is not None
            self.net = build_profile_model(self.source, self.job_seq_len, self.dtype, self.device, self.tp)
            self.timings["build"] = self.timings.get("build", 0.0) + time.perf_counter() - t0
        return self.net

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch is None:
            self.batch = example_batch(self.built(), self.seq_len, self.micro_batch, self.device)
        return self.batch
