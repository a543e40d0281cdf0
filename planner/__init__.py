"""memo.planner: trace parsing, DSA planning (heuristic, MIP, bi-level), plan files, alpha LP.

Entry point: ``make_plan(trace, alpha_solution=None, time_limit=60, solver="cbc") -> Plan``.
File formats: docs/formats.md.
"""

# NOTE [Import PuLP early]: PuLP's solver modules keep exceptions they catch while importing,
# and a traceback keeps its frames' callers alive. Imported lazily in the middle of a training
# step, that pins the step's model and activations for the life of the process; imported here,
# it pins only the importer of memo.planner.
import pulp  # noqa: F401

from .alpha import AlphaSolution, evaluate_alpha, host_memory_per_process, solve_alpha
from .calibrate import (
    PROBES,
    AlphaInputs,
    PolicyRecording,
    ProbedPolicy,
    RecordPolicy,
    alpha_of,
    corrected_costs,
    memo_calibration,
    probe_policy,
    with_recorded_full_recompute,
    with_recorded_memo,
)
from .core import (
    lower_bound,
    make_plan,
    plan_bilevel,
    plan_heuristic,
    plan_mip,
    solve_items,
)
from .plan import ALIGNMENT, Plan, load_plan, offload_difference, save_plan, validate_plan, without_unphased
from .policy import (
    LayerCosts,
    PolicySolution,
    choose_policy,
    describe_policy,
    device_need,
    full_recompute_need,
    given_policy,
)
from .summary import PlanSummary, read_plan_summary
from .trace import Allocation, Trace, TraceBuilder, load_trace, save_trace

__all__ = [
    "ALIGNMENT",
    "PROBES",
    "Allocation",
    "AlphaInputs",
    "AlphaSolution",
    "LayerCosts",
    "Plan",
    "PlanSummary",
    "PolicyRecording",
    "PolicySolution",
    "ProbedPolicy",
    "RecordPolicy",
    "Trace",
    "TraceBuilder",
    "alpha_of",
    "choose_policy",
    "corrected_costs",
    "describe_policy",
    "device_need",
    "full_recompute_need",
    "given_policy",
    "evaluate_alpha",
    "host_memory_per_process",
    "load_plan",
    "offload_difference",
    "load_trace",
    "lower_bound",
    "make_plan",
    "memo_calibration",
    "plan_bilevel",
    "plan_heuristic",
    "plan_mip",
    "probe_policy",
    "read_plan_summary",
    "save_plan",
    "save_trace",
    "solve_alpha",
    "solve_items",
    "validate_plan",
    "with_recorded_full_recompute",
    "with_recorded_memo",
    "without_unphased",
]
