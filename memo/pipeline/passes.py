"""Recording one iteration: the dispatch and allocator recorders with their progress bar, the
wrapped pass (the model wrapped by memo's runtime, traced, unwrapped), and pass 2 (NOTE [Two-pass
profiling] in memo/pipeline/__init__.py), which plans from the policy's last probe when it can."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memo.errors import MemoError
from memo.planner.vocab import Recorder
from memo.profiler.measure import Quantity, time_layer_forward
from memo.profiler.record import Recording, layer_inputs, model_parts, phase_tracker, record

from .result import ProbeKey, WrappedRun

if TYPE_CHECKING:
    from memo.planner import PolicySolution

    from .job import ProfileJob
    from .result import ProfileResult

__all__ = ["check_allocator_device", "pass2", "record_allocator", "record_pass", "time_first_layer",
           "wrapped_pass"]

@contextlib.contextmanager
def _progress(enabled: bool, total: int, desc: str) -> Iterator[Callable[[str | None], None] | None]:
    """A tqdm bar that advances on every phase change (a PhaseTracker listener)."""
    if not enabled or not sys.stderr.isatty():  # a redirected log gets the plain stage lines only
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="phase", file=sys.stderr, leave=False)

    def on_phase(phase: str | None) -> None:
        if phase is not None:
            bar.set_postfix_str(phase, refresh=False)
            bar.update(1)

    try:
        yield on_phase
    finally:
        bar.close()


def record_pass(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, progress: bool, desc: str, meta: dict[str, Any]
) -> Recording:
    tracker = phase_tracker(model)
    try:
        with _progress(progress, 2 * len(model_parts(model).layers) + 4, desc) as listener:
            if listener is not None:
                tracker.add_listener(listener)
            return record(model, ids, labels, tracker=tracker, meta=meta)
    finally:
        tracker.remove()


def record_allocator(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, meta: dict[str, Any], warmed: bool = False
) -> dict[str, Any]:
    """One iteration of ``model`` traced by memo.allocator.logging (:func:`.step.record_step`;
    ``warmed``: an iteration of this job already ran in this process)."""
    from .step import ModelStep, record_step

    return record_step(ModelStep(model, (ids, labels)), ids.device, meta, warmed=warmed)


def time_first_layer(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Quantity:
    """T_layer measured: the first layer's forward on the inputs the model gives it (NOTE [First
    layer's inputs] in memo/profiler/record.py)."""
    args, kwargs = layer_inputs(model, ids, labels)
    layer = model_parts(model).layers[0]
    return time_layer_forward(layer, *args, layer_kwargs=kwargs)


def wrapped_pass(job: ProfileJob, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, alpha: float,
                 progress: bool, plain: Recording, policy: list[str] | None = None,
                 tile_tokens: int | None = None) -> tuple[dict[str, Any], WrappedRun]:
    """Trace one iteration of ``model`` wrapped by memo's runtime with ``alpha``; unwrap afterwards.
    Returns the trace and what the runtime allocated and copied (:class:`WrappedRun`).

    The model is wrapped in place (NOTE [Wrapping in place] in memo/runtime/wrap.py) and
    restored whatever happens, so a model the caller passed comes back as it was given. A
    ``tile_tokens`` of None is the runtime's default on the device the plan is for (NOTE [Tiles of
    the device a plan is for] in memo/pipeline/job.py).
    """
    req, st = job.request, job.state
    from memo import runtime

    runtime.wrap(model, alpha=alpha, policy=policy, recompute_chunk_tokens=job.tile_tokens(tile_tokens))
    try:
        if req.recorder == Recorder.ALLOCATOR:
            trace = record_allocator(model, ids, labels, _target_meta(plain, ids.device, "allocator"),
                                     warmed=st.warmed)
            st.warmed = True
        else:
            trace = record_pass(model, ids, labels, progress, f"pass 2 (alpha={alpha:.3f})", st.meta).trace
        rt = runtime.runtime_of(model)
        return trace, WrappedRun(host_bytes=int(rt.host_bytes), layer_bytes=int(rt.layer_bytes or 0),
                                 offloaded_layers=int(rt.n_offloaded), tensors=list(rt.layer_tensors))
    finally:
        runtime.unwrap(model, force=True)


def _target_meta(plain: Recording, device: torch.device, recorder: str) -> dict[str, Any]:
    """Pass 1's trace meta, for a trace recorded on ``device`` by ``recorder``."""
    return {**plain.trace["meta"], "device": device.type, "recorder": recorder}


def check_allocator_device(device: torch.device) -> None:
    """The allocator recorder sees real allocations: refuse meta, and install memo's CUDA allocator."""
    if device.type == "meta":
        raise MemoError(
            "memo.profiler: the allocator recorder records real allocations, which the meta device never "
            "makes; use recorder='dispatch' (--recorder dispatch) on meta, or a cpu/cuda device"
        )
    if device.type == "cuda":
        from memo import allocator

        # memo's CUDA allocator must be PyTorch's before the first CUDA tensor exists.
        if not allocator.cuda_installed():
            allocator.install_cuda()


def pass2(job: ProfileJob, plain: Recording, chosen: PolicySolution, wrap_pass: bool | None, plan: bool,
          result: ProfileResult) -> WrappedRun | None:
    """Pass 2 (NOTE [Two-pass profiling]): the trace the plan is made from. Returns what the runtime
    allocated and copied when the wrapped model ran (None when it did not)."""
    req, st = job.request, job.state
    net = job.built()
    ids, labels = job.inputs()
    second: dict[str, Any] | None = None
    wrapped: WrappedRun | None = None
    t0 = time.perf_counter()
    probed = st.last_probe
    if wrap_pass is not False and probed is not None and probed[0] == _probe_key(result.alpha.alpha, chosen):
        _, second, wrapped = probed  # NOTE [Pass 2 is the last probe]
        result.wrapped = True
    elif wrap_pass is not False:
        req.say(f"pass 2 ({req.device.type}): recording one iteration of the model wrapped with alpha "
                f"{result.alpha.alpha:.4f} ...")
        try:
            second, wrapped = wrapped_pass(job, net, ids, labels, result.alpha.alpha, req.progress, plain,
                                            chosen.policy, chosen.tile_tokens)
            result.wrapped = True
        except MemoError as err:
            if wrap_pass:
                raise
            st.notes.append(
                f"pass 2 could not run the wrapped model ({err}); the plan comes from the plain model"
            )
    sized_elsewhere = plain.trace["meta"]["device"] != req.device.type
    if second is None and plan and (req.recorder == Recorder.ALLOCATOR or sized_elsewhere):
        # The planned trace must come from the device that will run (and, for the allocator
        # recorder, from the allocator's own requests), even when the model cannot be wrapped.
        if req.recorder == Recorder.ALLOCATOR:
            second = record_allocator(net, ids, labels, _target_meta(plain, req.device, "allocator"),
                                      warmed=st.warmed)
        else:
            second = record_pass(net, ids, labels, req.progress, "pass 2 (plain model)", st.meta).trace
    if second is not None:
        second["layers"] = plain.trace["layers"]
        result.trace = second
        st.timings["pass2"] = time.perf_counter() - t0
        what = f"wrapped, alpha {result.alpha.alpha:.4f}" if result.wrapped else "plain model"
        how = ("the policy's last probe, not recorded again" if second is (probed or (None, None))[1]
               else f"in {st.timings['pass2']:.1f} s")
        req.say(f"pass 2 ({what}, {req.recorder} recorder): {len(second['events']):,} events, {how}")
    return wrapped


# NOTE [Pass 2 is the last probe]
# The policy's last recording (``job.state.last_probe``, kept by every recording of the policy's StepProbe in
# memo/pipeline/policy.py) is the very iteration pass 2 records when its (alpha, policy, tile) is the
# chosen one: the same model and batch, wrapped the same way, by the same recorder. Recording it again
# only costs time (a third of a profile of gpt-125m at 8K on meta, minutes at scale), so pass 2 takes
# it. Any other choice (a given alpha, a policy that was not recorded) is recorded here.
def _probe_key(alpha: float, chosen: PolicySolution) -> ProbeKey:
    return (float(alpha), tuple(chosen.policy), chosen.tile_tokens)
