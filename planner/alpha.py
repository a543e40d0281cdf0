"""The alpha LP: how much of each layer's "other" skeletal tensors to offload.

    maximise   alpha
    subject to (S_input + S_attn + alpha * S_others) / B <= T_layer         (bandwidth: copy hides)
               n_memo * (S_input + S_attn + alpha * S_others) <= M_CPU      (host memory)
               D_fixed + alpha * D_alpha <= M_device                         (device memory, optional)
               0 <= alpha <= 1

``n_memo`` is the number of offloaded layers: ``n_layers - 2`` by default (the paper's rule),
or what the per-layer policy offloads (planner/policy.py), which also supplies the device
constraint's coefficients.

The input and attention output are always offloaded (attention is never
recomputed), so alpha = 0 must fit in host memory: if it does not, training
cannot run and :func:`solve_alpha` raises MemoError with the numbers. If even
alpha = 0 does not hide under the layer's compute, alpha = 0 is returned with
binding "bandwidth" and a warning: the copies then stall compute, which is
slower but correct.

``binding`` is the constraint that stops alpha from growing: "alpha<=1"
(everything offloaded, nothing recomputed), "bandwidth", "host_memory" or "device_memory".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from memo.errors import MemoError
from memo.units import format_bytes, format_ms

from .solvers import quiet_pulp

__all__ = ["AlphaSolution", "host_memory_per_process", "solve_alpha"]

GiB = 2**30


@dataclass(frozen=True)
class AlphaSolution:
    """Solution of the alpha LP.

    Attributes:
        alpha: fraction of tokens of the "other" skeletal tensors offloaded (the rest recomputed).
        binding: "alpha<=1", "bandwidth" or "host_memory".
        bytes_per_layer: S_input + S_attn + alpha * S_others (bytes copied per layer).
        copy_seconds: bytes_per_layer / bandwidth.
        layer_time: T_layer in seconds.
        host_bytes: pinned host bytes needed: (n_layers - 2) * bytes_per_layer.
        host_memory: M_CPU the LP was given.
        copies_hidden: whether the copy of one layer fits in one layer's compute.
    """

    alpha: float
    binding: str
    bytes_per_layer: int
    copy_seconds: float
    layer_time: float
    host_bytes: int
    host_memory: int
    copies_hidden: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MemoError(f"memo.alpha: {name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise MemoError(f"memo.alpha: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def host_memory_per_process(node_bytes: int, gpus_per_node: int, safety: float = 0.8) -> int:
    """Host memory one training process may pin: ``safety * node_bytes / gpus_per_node``."""
    _check("node_bytes", node_bytes)
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node <= 0:
        raise MemoError(f"memo.alpha: gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if not (0 < _check("safety", safety) <= 1):
        raise MemoError(f"memo.alpha: safety must be in (0, 1], got {safety!r}")
    return int(node_bytes * safety // gpus_per_node)


@quiet_pulp
def _inputs(s_input: float, s_attn: float, s_others: float, bandwidth: float, layer_time: float,
            n_layers: int, host_memory: float, offloaded_layers: int | None = None,
            ) -> tuple[float, float, float, float, float, int, float]:
    """Checked LP inputs, with ``n_layers`` turned into the number of offloaded layers; refuses
    a host memory that cannot hold even alpha=0."""
    s_input = _check("s_input", s_input, allow_zero=True)
    s_attn = _check("s_attn", s_attn, allow_zero=True)
    s_others = _check("s_others", s_others, allow_zero=True)
    bandwidth = _check("bandwidth", bandwidth)
    layer_time = _check("layer_time", layer_time)
    host_memory = _check("host_memory", host_memory, allow_zero=True)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
        raise MemoError(f"memo.alpha: n_layers must be a positive integer, got {n_layers!r}")
    kept = max(n_layers - 2, 0) if offloaded_layers is None else int(offloaded_layers)
    if not 0 <= kept <= n_layers:
        raise MemoError(f"memo.alpha: offloaded_layers must be in [0, n_layers={n_layers}], "
                        f"got {offloaded_layers!r}")
    base = s_input + s_attn
    if kept * base > host_memory:
        raise MemoError(
            f"memo.alpha: host memory too small even with alpha=0: {kept} offloaded layers x "
            f"(S_input {s_input / GiB:.3f} GiB + S_attn {s_attn / GiB:.3f} GiB) = "
            f"{kept * base / GiB:.3f} GiB > M_CPU {host_memory / GiB:.3f} GiB. Use more host memory, "
            "more GPUs (shorter sequence per GPU, e.g. `memo profile --tensor-parallel`) or a shorter "
            "sequence.")
    return s_input, s_attn, s_others, bandwidth, layer_time, kept, host_memory


def evaluate_alpha(alpha: float, s_input: float, s_attn: float, s_others: float, bandwidth: float,
                   layer_time: float, n_layers: int, host_memory: float, *,
                   offloaded_layers: int | None = None) -> AlphaSolution:
    """A given alpha measured against the LP's constraints (binding ``"given"``).

    Refuses (with the numbers) an alpha whose offload does not fit in host memory; reports
    in ``copies_hidden`` whether its copies hide under one layer's compute.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise MemoError(f"memo.alpha: alpha must be a number in [0, 1], got {alpha!r}")
    s_input, s_attn, s_others, bandwidth, layer_time, kept, host_memory = _inputs(
        s_input, s_attn, s_others, bandwidth, layer_time, n_layers, host_memory, offloaded_layers)
    per_layer = s_input + s_attn + alpha * s_others
    if kept * per_layer > host_memory:
        raise MemoError(
            f"memo.alpha: alpha={alpha} offloads {kept} layers x {per_layer / GiB:.3f} GiB = "
            f"{kept * per_layer / GiB:.3f} GiB > M_CPU {host_memory / GiB:.3f} GiB; lower alpha or let "
            "memo solve it (--alpha auto)")
    return AlphaSolution(alpha=float(alpha), binding="given", bytes_per_layer=int(math.ceil(per_layer)),
                         copy_seconds=per_layer / bandwidth, layer_time=layer_time,
                         host_bytes=int(math.ceil(kept * per_layer)), host_memory=int(host_memory),
                         copies_hidden=per_layer / bandwidth <= layer_time * (1 + 1e-9))


def solve_alpha(s_input: float, s_attn: float, s_others: float, bandwidth: float, layer_time: float,
                n_layers: int, host_memory: float, *, offloaded_layers: int | None = None,
                device_memory: float | None = None, device_fixed: float = 0.0,
                device_per_alpha: float = 0.0) -> AlphaSolution:
    """Largest alpha in [0, 1] whose offload hides under compute and fits in host memory.

    Args:
        s_input, s_attn, s_others: skeletal bytes per layer (layer input, attention output,
            all other skeletal tensors).
        bandwidth: host<->device bytes per second (B).
        layer_time: forward seconds of one layer (T_layer).
        n_layers: transformer layers; the last two go straight to backward and are not offloaded
            unless ``offloaded_layers`` says how many layers offload.
        host_memory: bytes of pinned host memory this process may use (M_CPU).
        device_memory, device_fixed, device_per_alpha: the device constraint
            ``device_fixed + alpha * device_per_alpha <= device_memory`` (bytes; None: no constraint);
            the caller has checked that alpha = 0 fits.
    """
    import pulp

    s_input, s_attn, s_others, bandwidth, layer_time, kept, host_memory = _inputs(
        s_input, s_attn, s_others, bandwidth, layer_time, n_layers, host_memory, offloaded_layers)
    base = s_input + s_attn
    hidden_at_zero = base / bandwidth <= layer_time
    prob = pulp.LpProblem("memo_alpha", pulp.LpMaximize)
    alpha = pulp.LpVariable("alpha", lowBound=0, upBound=1)
    prob += alpha
    # Scale bytes to GiB so the LP's coefficients stay near 1 (CBC tolerances are absolute).
    if hidden_at_zero:
        prob += (base + alpha * s_others) / GiB <= layer_time * bandwidth / GiB, "bandwidth"
    if kept:
        prob += kept * (base + alpha * s_others) / GiB <= host_memory / GiB, "host_memory"
    if device_memory is not None and device_per_alpha > 0:
        prob += (device_fixed + alpha * device_per_alpha) / GiB <= device_memory / GiB, "device_memory"
    prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[prob.status] != "Optimal":
        raise MemoError(f"memo.alpha: the LP solver returned {pulp.LpStatus[prob.status]}; "
                        "inputs: " + repr((s_input, s_attn, s_others, bandwidth, layer_time, n_layers,
                                           host_memory)))
    value = min(1.0, max(0.0, float(alpha.varValue or 0.0)))
    # Snap solver noise (1e-9 relative) so alpha=1 and alpha=0 come out exact.
    if value > 1 - 1e-9:
        value = 1.0
    if value < 1e-12:
        value = 0.0
    if not hidden_at_zero:
        value = 0.0
        binding = "bandwidth"
        warnings.warn(
            f"memo.alpha: even alpha=0 copies {format_bytes(base)} per layer (the input and the attention "
            f"output), which takes {format_ms(base / bandwidth * 1e3)} at {bandwidth / 1e9:.3g} GB/s, longer "
            f"than one layer's forward ({format_ms(layer_time * 1e3)}): offload will stall compute. Give a "
            "faster link (--bandwidth-gbps) or a longer sequence, or use full recompute", stacklevel=2)
    elif value >= 1.0:
        binding = "alpha<=1"
    else:
        bw_limit = (layer_time * bandwidth - base) / s_others if s_others else math.inf
        host_limit = (host_memory / kept - base) / s_others if kept and s_others else math.inf
        device_limit = ((device_memory - device_fixed) / device_per_alpha
                        if device_memory is not None and device_per_alpha > 0 else math.inf)
        limits = {"bandwidth": bw_limit, "host_memory": host_limit, "device_memory": device_limit}
        binding = min(limits, key=limits.__getitem__)
    per_layer = base + value * s_others
    return AlphaSolution(alpha=value, binding=binding, bytes_per_layer=int(math.ceil(per_layer)),
                         copy_seconds=per_layer / bandwidth, layer_time=layer_time,
                         host_bytes=int(math.ceil(kept * per_layer)), host_memory=int(host_memory),
                         copies_hidden=hidden_at_zero and per_layer / bandwidth <= layer_time * (1 + 1e-9))
