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
from memo.errors import internal_assert
from memo.machine import Machine
from memo.planner.vocab import Recorder

from .device import iteration_total

if TYPE_CHECKING:
    from memo.planner import Trace

    from .result import ProbeKey, WrappedRun

__all__ = ["ProfileJob", "ResolvedRequest", "ProfileState", "build_profile_model", "example_batch"]


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


# NOTE [Tiles of the device a plan is for]
# A memo layer's token tiles have a floor that depends on the device (NOTE [How small a chunk] in
# memo/runtime/tiles.py): on the CPU and on meta 2,048 tokens at hidden 128 and 256 from hidden
# 362 up, ~2,048 at hidden 4096 on a GPU. A plan
# made on meta is made for some other device, and its tiles must be that device's: the plan's
# transient bytes are the recorded tiles', and a GPU running CPU-sized tiles regresses in step time
# (many small kernels, the host's launch cost exposed) while meta records ~8x the ops. The rule,
# visible in one place (ResolvedRequest.tile_device_type): a profile on meta with ``machine.gpu`` given
# (``--gpu h100``, the GPU whose FLOPs estimate the layer time) is for a CUDA device, and is tiled with the
# GPU's floor; without ``gpu`` meta keeps the CPU's floor, so a plan made on meta is still the plan
# made on the CPU (tests/runtime/test_plan_truth.py). A profile on cpu or cuda is for its own device.
# The policy's cost model and tile choices use the target's floor (layer_costs in policy.py). Where
# the target is not pass 2's device, the runtime on meta cannot make the target's default itself, so
# every wrapped pass gets the tile explicitly (``default_tile``: default_tile_tokens of the layer's
# rows on the target) and the plan records it, default or not (``plan.tile_tokens``): the runtime
# that replays the plan runs exactly those tiles on any device. Elsewhere a default tile stays None
# in the plan: the runtime of the plan's own device type makes the same default per
# token range ([0:a] and [a:s] each), which one recorded number could not say.
@dataclass(frozen=True)
class ResolvedRequest:
    """What one profile is asked for: the arguments of :func:`memo.pipeline.profile`, resolved."""

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
    recorder: Recorder
    progress: bool
    say: Callable[[str], None]
    #: The largest of a number over the ranks profiling together (NOTE [Decisions every rank shares]).
    agree_max: Callable[[int], int] = int
    #: Where the plan puts the parameter gradients: make_plan's ``gradients`` (NOTE [Allocations that
    #: outlive the iteration] in planner/outliving.py).
    gradients: str = "arena"

    @property
    def tile_device_type(self) -> str:
        """The device type whose tiles the profile records and plans (NOTE [Tiles of the device a
        plan is for]): ``"cuda"`` for a profile on meta for a GPU (``machine.gpu``), else pass 2's."""
        if self.device.type == "meta" and self.machine.gpu is not None:
            return "cuda"
        return self.device.type


@dataclass
class ProfileState:
    """What one profile builds and finds as its steps run."""

    net: nn.Module | None = None  # the model on its device (None until a named model is built there)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: The last wrapped iteration a policy probe recorded, by (alpha, policy, tile): pass 2 of the
    #: same choice takes it instead of recording it again (NOTE [Pass 2 is the last probe]).
    last_probe: tuple[ProbeKey, dict[str, Any], WrappedRun] | None = None
    #: The tile the wrapped passes run, and the plan records, where the policy keeps the runtime's
    #: default but pass 2's device is not the device the plan is for (NOTE [Tiles of the device a
    #: plan is for]); None where that device's own default is what runs. Set with the cost model.
    default_tile: int | None = None
    #: Whether an iteration of the model has run on the job's device in this process (NOTE [Warm-up
    #: before logging] in memo/pipeline/step.py).
    warmed: bool = False


@dataclass(frozen=True)
class ProfileJob:
    """One run of the pipeline: the frozen request and the state its steps fill in."""

    request: ResolvedRequest
    state: ProfileState

    def tile_tokens(self, chosen: int | None) -> int | None:
        """The tile the runtime runs, and the plan records, for the policy's ``chosen`` tile (None:
        the runtime's default)."""
        return chosen if chosen is not None else self.state.default_tile

    def recorded_total(self, trace: Trace | dict[str, Any], static: int) -> int:
        """:func:`iteration_total` of a recorded iteration, the same on every rank."""
        return self.request.agree_max(iteration_total(trace, static))

    def built(self) -> nn.Module:
        """The model on its device, built there the first time for a model given by name."""
        state, req = self.state, self.request
        if state.net is None:
            t0 = time.perf_counter()
            internal_assert(req.source is not None, "memo.pipeline: a job without a model names its source")
            state.net = build_profile_model(str(req.source), req.job_seq_len, req.dtype, req.device, req.tp)
            state.timings["build"] = state.timings.get("build", 0.0) + time.perf_counter() - t0
        return state.net

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state.batch is None:
            self.state.batch = example_batch(self.built(), self.request.seq_len, self.request.micro_batch,
                                             self.request.device)
        return self.state.batch
