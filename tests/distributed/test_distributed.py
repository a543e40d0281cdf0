"""memo inside megatron-core's parallel layouts, several CPU processes over gloo (issue #14).

Layouts: TP=2 with sequence parallelism and CP=2, by all-gather and by Ulysses all-to-all (one
world-2 launch, one layout after the other), TP=2 x DP=2 under megatron-core's
``DistributedDataParallel`` (``overlap_grad_reduce``, ``use_distributed_optimizer``,
``finalize_model_grads``) then Ulysses CP=4 (one world-4 launch). Per layout, model
style (GPT: LayerNorm, GELU, biases; Llama: RMSNorm, SwiGLU, GQA, RoPE, no biases) and alpha:

- ``layout``: the unwrapped layers in the layout give the single-process (TP=1, CP=1, DP=1)
  computation of the same weights on the full sequence and batch: loss, this rank's rows of the
  output and input gradient, every parameter gradient (this rank's TP slice of it);
- ``memo``: ``memo.wrap(model, alpha)`` gives what its unwrapped twin gives in the same layout.

A launch costs 20-30 s (importing megatron-core), so each one runs every check and the tests read
its records (tests/dist_harness.py). megatron-core is imported in the worker processes only.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from tests import dist_harness
from tests.dist_harness import LaunchError, check
from tests.grads import RTOL, rel_err

pytestmark = pytest.mark.megatron

STYLES = ("gpt", "llama")
ALPHAS = (0.0, 0.25, 0.5, 1.0)
HIDDEN, HEADS, GROUPS, FFN, LAYERS, BATCH = 32, 4, 2, 64, 2, 2
# Global sequence lengths: TP2+SP holds 7 rows per rank (alpha*7 is never whole but at 0 and 1);
# CP=2 cuts 20 into 4 chunks of 5, rank r holding chunks r and 3-r (10 rows: alpha=0.25 -> 2.5).
# Ulysses (a2a) keeps that layout: cp2a2a as cp2; cp4a2a cuts 24 into 8 chunks of 3 (6 rows a rank).
SEQ = {"tp2sp": 14, "cp2": 20, "cp2a2a": 20, "tp2dp2": 13, "cp4a2a": 24}
MODULE = "tests.distributed.test_distributed"


# ----------------------------------------------------------------------------- worker side


def _config(style: str, tp: int = 1, cp: int = 1, sp: bool = False, cp_comm: str | None = None) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, context_parallel_size=cp,
        sequence_parallel=sp, cp_comm_type=cp_comm)
    if style == "gpt":
        kw.update(normalization="LayerNorm", add_bias_linear=True, activation_func=F.gelu)
    else:
        kw.update(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                  activation_func=F.silu, num_query_groups=GROUPS)
    return TransformerConfig(**kw)


def _rope(s: int) -> torch.Tensor:
    """Megatron's rotary table ``[s, 1, 1, head_dim]``."""
    d = HIDDEN // HEADS
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _data(s: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(s, b, HIDDEN, generator=g), torch.randn(s, b, HIDDEN, generator=g)


def _cp_rows(s: int, c: int, r: int) -> torch.Tensor:
    """Positions held by CP rank r of c: chunks r and 2c-1-r of 2c (megatron's load-balanced layout)."""
    m = s // (2 * c)
    return torch.cat([torch.arange(r * m, (r + 1) * m), torch.arange((2 * c - 1 - r) * m, (2 * c - r) * m)])


class _CpReferenceAttention(torch.nn.Module):
    """The test's own context-parallel causal attention (K/V all-gathered over the CP group, backward a
    reduce-scatter; load-balanced layout), used for the unwrapped CP run while memo's core attention
    refuses context parallelism. ``(q [s,b,np,hn], k, v [s,b,ng,hn]) -> [s, b, np*hn]``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 **_: Any) -> None:
        super().__init__()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
                **_: Any) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        group = parallel_state.get_context_parallel_group()
        c, r = group.size(), group.rank()
        key = gather_from_sequence_parallel_region(key, True, group=group)  # rank-major rows
        value = gather_from_sequence_parallel_region(value, True, group=group)
        s = query.shape[0]
        q_pos = _cp_rows(s * c, c, r)
        k_pos = torch.cat([_cp_rows(s * c, c, j) for j in range(c)])
        rep = query.shape[2] // key.shape[2]
        key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) / math.sqrt(query.shape[-1])
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        o = torch.einsum("bnst,tbnd->sbnd", scores.softmax(dim=-1), value)
        return o.reshape(s, query.shape[1], -1)


def _spec(config: Any, core: Any = None) -> Any:
    from memo.adapters.megatron import get_memo_gpt_layer_local_spec
    from memo.distributed.cpu_shims import sequence_parallel_norms

    layer = get_memo_gpt_layer_local_spec()
    if core is not None:
        layer.submodules.self_attention.submodules.core_attention = core
    return sequence_parallel_norms(layer, config)


def _build(config: Any, core: Any = None, like: torch.nn.Module | None = None) -> torch.nn.Module:
    """Megatron modules hold process groups and cannot be deep-copied: build again (same seed)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    model = TransformerBlock(config, spec=_spec(config, core))
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


def _step(model: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, rope: torch.Tensor | None,
          scale: float = 1.0) -> dict[str, Any]:
    """One forward and backward of ``scale * sum(model(x) * w)``: loss, output, input grad, param grads."""
    model.zero_grad(set_to_none=True)
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    inp = x.clone().requires_grad_()
    y = model(hidden_states=inp, attention_mask=None, rotary_pos_emb=rope)
    loss = scale * (y * w).sum()
    loss.backward()
    return {"loss": loss.detach(), "y": y.detach(), "dx": inp.grad}


def _param_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None) if p.grad is None else p.grad
        if g is not None:
            out[n.removeprefix("module.")] = g.detach().clone()
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n.removeprefix("module."): p for n, p in model.named_parameters()}


def _tp_slice(full: torch.Tensor, p: torch.nn.Parameter, tp: int, r: int) -> torch.Tensor:
    """This TP rank's part of a TP=1 tensor for parameter ``p`` (megatron's CPU init: the master weight
    split in tp*stride pieces along partition_dim, rank r keeping pieces r, r+tp, ...)."""
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    pieces = full.chunk(tp * stride, dim=dim)
    return torch.cat(pieces[r::tp], dim=dim)


def _compare(name: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    if got.keys() != ref.keys() or not ref:
        raise AssertionError(f"{name}: gradients of {sorted(got)} against {sorted(ref)}")
    worst = max((rel_err(got[n], ref[n]), n) for n in ref)
    if not worst[0] <= RTOL:
        raise AssertionError(f"{name}: gradient of {worst[1]} differs: relative error {worst[0]:.3g}")
    return f"worst parameter gradient {worst[1]}: {worst[0]:.2g}"


def _same(what: str, a: torch.Tensor, b: torch.Tensor) -> float:
    err = rel_err(a, b)
    if not err <= RTOL:
        raise AssertionError(f"{what} differs: relative error {err:.3g}")
    return err


def _reference(style: str, s: int, b: int) -> dict[str, Any]:
    """The single-process computation (run under TP=1, CP=1 on every rank: no collective involved)."""
    x, w = _data(s, b)
    model = _build(_config(style))
    out = _step(model, x, w, _rope(s) if style == "llama" else None)
    out["grads"] = _param_grads(model)
    return out


def _init(tp: int = 1, cp: int = 1) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(0)


def _wrapped_runs(record: dict[str, Any], name: str, model: torch.nn.Module, run: Any, twin: dict[str, Any],
                  reduce: Any, chunk_tokens: int | None = None) -> None:
    """``memo.wrap(model, alpha)`` for each alpha against the unwrapped twin's ``twin`` results;
    ``chunk_tokens``: the recomputed range in chunks of that many tokens (NOTE [Chunked recompute])."""
    import memo.runtime as mr

    for alpha in ALPHAS:
        def one(alpha: float = alpha) -> str:
            # Every layer through memo's token-wise path (the default policy keeps the last layers
            # of so small a model as they are: NOTE [Layer policy]).
            mr.wrap(model, runtime=mr.MemoRuntime(alpha, policy=["memo"] * LAYERS,
                                                  recompute_chunk_tokens=chunk_tokens))
            try:
                n = mr.runtime_of(model).n_layers
                if n != LAYERS:
                    raise AssertionError(f"memo.wrap took {n} layer(s), expected {LAYERS}")
                got = run(model)
                moved = mr.runtime_of(model).layer_bytes
                if not moved:
                    raise AssertionError(f"memo offloaded nothing (layer_bytes={moved})")
            finally:
                if mr.is_wrapped(model):
                    mr.unwrap(model)
            reduce(got)
            _same("loss", got["loss"], twin["loss"])
            _same("output", got["y"], twin["y"])
            _same("input gradient", got["dx"], twin["dx"])
            return f"{_compare(name, got['grads'], twin['grads'])}; layer_bytes {moved}"

        check(record, f"{name}/memo/alpha={alpha}", one)


def _context_parallel_layouts(record: Any, layout: str, refs: dict[tuple[str, int], dict[str, Any]],
                              cp_comm: str | None, blackbox: bool) -> None:
    """Layout ``layout`` (``SEQ[layout]`` tokens) over megatron's context-parallel group, already set up:
    each style's unwrapped layers against the single-process ``refs``, memo against them, and with
    ``blackbox`` the test's own CP attention as a core attention memo does not know."""
    from megatron.core import parallel_state

    cp_group, r = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
    c = cp_group.size()
    s = SEQ[layout]
    rows = _cp_rows(s, c, r)
    for style in STYLES:
        ref = refs[(style, s)]
        x, w = _data(s, BATCH)
        rope = _rope(s)[rows] if style == "llama" else None

        def reduce_cp(out: dict[str, Any]) -> None:
            torch.distributed.all_reduce(out["loss"], group=cp_group)
            for g in out["grads"].values():  # every weight saw only this rank's tokens
                torch.distributed.all_reduce(g, group=cp_group)

        def run_cp(model: torch.nn.Module, x: torch.Tensor = x, w: torch.Tensor = w,
                   rope: Any = rope) -> dict:
            out = _step(model, x[rows], w[rows], rope)
            out["grads"] = _param_grads(model)
            return out

        name = f"{layout}/{style}"
        cfg = _config(style, cp=c, cp_comm=cp_comm)
        memo_built: list[torch.nn.Module] = []

        def build(cfg: Any = cfg, built: list = memo_built) -> str:
            built.append(_build(cfg))
            comm = built[0].layers[0].self_attention.core_attention.cp_comm_type
            if comm != (cp_comm or "all_gather"):
                raise AssertionError(f"memo's core attention communicates by {comm}, not {cp_comm}")
            return comm

        check(record, f"{name}/memo/build", build)
        # The unwrapped run uses memo's core attention where it builds under CP, the test's own otherwise.
        unwrapped = memo_built[0] if memo_built else _build(cfg, core=_CpReferenceAttention)
        twin = run_cp(unwrapped)
        reduce_cp(twin)

        def layout_cp(ref: dict = ref, twin: dict = twin, name: str = name) -> str:
            _same("loss", twin["loss"], ref["loss"])
            _same("output rows", twin["y"], ref["y"][rows])
            _same("input gradient rows", twin["dx"], ref["dx"][rows])
            return _compare(name, twin["grads"], ref["grads"])

        check(record, f"{name}/layout", layout_cp)
        if memo_built:
            _wrapped_runs(record, name, _build(cfg, like=unwrapped), run_cp, twin, reduce_cp)
            if blackbox:  # a context-parallel core attention memo does not know runs as the layer's own
                box = _build(cfg, core=_CpReferenceAttention, like=unwrapped)
                _wrapped_runs(record, f"{name}/blackbox", box, run_cp, twin, reduce_cp, chunk_tokens=2)
        else:
            for alpha in ALPHAS:
                record(f"{name}/memo/alpha={alpha}", False,
                       f"not run: memo's layers did not build under CP={c}")


def layouts_world2(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    """TP=2 + SP, then CP=2 (all-gather, then all-to-all), each against the single-process run and memo
    against the unwrapped twin."""
    from megatron.core import parallel_state

    from memo.distributed.cpu_shims import install_cpu_shims

    warnings.simplefilter("ignore")
    install_cpu_shims()
    _init()
    refs = {(st, s): _reference(st, s, BATCH) for st in STYLES for s in (SEQ["tp2sp"], SEQ["cp2"])}

    # TP=2 with sequence parallelism: rank r holds rows [r*s/2, (r+1)*s/2) of the layer input/output.
    _init(tp=2)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    r = parallel_state.get_tensor_model_parallel_rank()
    s = SEQ["tp2sp"]
    rows = torch.arange(r * s // 2, (r + 1) * s // 2)
    for style in STYLES:
        ref = refs[(style, s)]
        x, w = _data(s, BATCH)
        rope = _rope(s) if style == "llama" else None

        def run(model: torch.nn.Module, x: torch.Tensor = x, w: torch.Tensor = w, rope: Any = rope) -> dict:
            out = _step(model, x[rows], w[rows], rope)
            out["grads"] = _param_grads(model)
            return out

        name = f"tp2sp/{style}"
        cfg = _config(style, tp=2, sp=True)
        unwrapped = _build(cfg)
        params = _params(unwrapped)

        def reduce(out: dict[str, Any], params: dict = params) -> None:
            # NOTE [Sequence-parallel norm] in memo/distributed/cpu_shims.py: partial sums over tokens.
            torch.distributed.all_reduce(out["loss"], group=tp_group)
            for n, p in params.items():
                if getattr(p, "sequence_parallel", False) and n in out["grads"]:
                    torch.distributed.all_reduce(out["grads"][n], group=tp_group)

        twin = run(unwrapped)
        reduce(twin)

        def layout(ref: dict = ref, twin: dict = twin, params: dict = params, name: str = name) -> str:
            _same("loss", twin["loss"], ref["loss"])
            _same("output rows", twin["y"], ref["y"][rows])
            _same("input gradient rows", twin["dx"], ref["dx"][rows])
            sliced = {n: _tp_slice(g, params[n], 2, r) for n, g in ref["grads"].items()}
            return _compare(name, twin["grads"], sliced)

        check(record, f"{name}/layout", layout)
        check(record, f"{name}/memo/build", lambda: None)
        _wrapped_runs(record, name, _build(cfg, like=unwrapped), run, twin, reduce)
        # A core attention memo does not know, as a black box (NOTE [Black-box core attention]), its
        # gathered rows put in sequence order around it over several recompute chunks (NOTE [Gathered
        # rows in sequence order]): the test's own attention, over a context-parallel group of one.
        box = _build(cfg, core=_CpReferenceAttention, like=unwrapped)
        _wrapped_runs(record, f"{name}/blackbox", box, run, twin, reduce, chunk_tokens=2)

    # CP=2: rank r holds chunks r and 3-r of 4; RoPE rows sliced by the same positions. K and V
    # all-gathered, then the same layout by Ulysses all-to-all (NOTE [Ulysses context parallelism]).
    _init(cp=2)
    _context_parallel_layouts(record, "cp2", refs, cp_comm=None, blackbox=True)
    _context_parallel_layouts(record, "cp2a2a", refs, cp_comm="a2a", blackbox=False)
    parallel_state.destroy_model_parallel()
    check(record, "train/cp2a2a", _ulysses_train_plan_vs_peak)


#: plan's device total vs measured peak (the bar of tests/runtime/test_plan_truth.py)
TOTAL_TOL = 0.03


def _ulysses_train_plan_vs_peak() -> str:
    """``memo train --engine megatron --cp 2 --cp-comm a2a`` in this world (memo's strategy, alpha 0.5):
    each rank's plan (its Ulysses rank profiled: the all-to-all's head-sharded copies in the trace) is
    within TOTAL_TOL of the peak the rank measures, with planned allocations served."""
    from memo.train.loop import TrainConfig, train
    from memo.train.strategies import StrategyOptions, make_strategy

    strategy = make_strategy(StrategyOptions(alpha=0.5, layer_ms=5.0, bandwidth_gbps=10.0, host_mem_gb=64.0,
                                             time_limit=1.0))
    config = TrainConfig(engine="megatron", model="tiny", seq_len=512, micro_batch=1, steps=2,
                         context_parallel=2, cp_comm="a2a")
    result = train(config, progress=False, strategy=strategy, log=lambda _line: None)
    total = int(strategy.plan.device["total_bytes"])
    measured = max(int(s.peak_memory_bytes) for s in result.steps)
    counts = result.steps[-1].extras["allocator"]
    assert counts["planned"] > 0, counts
    assert result.parallel["cp"] == 2 and result.parallel["cp_comm"] == "a2a", result.parallel
    # ZeRO-1 over the two CP ranks (NOTE [ZeRO-1 under megatron]): each holds a part of the AdamW states
    every_state = 2 * 4 * result.num_parameters
    held = int(strategy.plan.device["model_states"]["optimizer"]["bytes"])
    assert 0 < held < every_state, (held, every_state)
    what = f"plan total {total:,} B, measured {measured:,} B ({(measured - total) / total:+.2%})"
    assert abs(measured - total) <= TOTAL_TOL * total, what
    return f"{what}; optimizer states {held:,} of {every_state:,} B; allocations {counts}"


def ddp_world4(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    """TP=2 x DP=2 under megatron-core DDP (overlap_grad_reduce, distributed optimizer,
    finalize_model_grads), then CP=4 by Ulysses all-to-all."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from memo.distributed.cpu_shims import install_cpu_shims

    warnings.simplefilter("ignore")
    install_cpu_shims()
    s, dp, b = SEQ["tp2dp2"], 2, BATCH
    _init()
    cp4_refs = {(st, SEQ["cp4a2a"]): _reference(st, SEQ["cp4a2a"], BATCH) for st in STYLES}
    refs = {}
    for style in STYLES:  # the whole batch of both data-parallel ranks, loss averaged over them as DDP does
        x, w = _data(s, dp * b)
        model = _build(_config(style))
        refs[style] = _step(model, x, w, _rope(s) if style == "llama" else None, scale=1.0 / dp)
        refs[style]["grads"] = _param_grads(model)

    _init(tp=2)
    tp_r, dp_r = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    cols = torch.arange(dp_r * b, (dp_r + 1) * b)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                               grad_reduce_in_fp32=True, bucket_size=4096)

    def gather_shards(model: Any) -> None:
        """The distributed optimizer's view made whole: every rank all-gathers its reduced shards."""
        for group in model.bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[group.intra_distributed_optimizer_instance_rank]
                torch.distributed.all_gather_into_tensor(bucket.grad_data, mine.clone(),
                                                         group=group.intra_distributed_optimizer_instance_group)

    for style in STYLES:
        ref = refs[style]
        x, w = _data(s, dp * b)
        rope = _rope(s) if style == "llama" else None
        cfg = _config(style, tp=2)

        def run(model: Any, x: torch.Tensor = x, w: torch.Tensor = w, rope: Any = rope) -> dict:
            out = _step(model, x[:, cols], w[:, cols], rope)
            finalize_model_grads([model])
            gather_shards(model)
            out["grads"] = _param_grads(model)
            return out

        def reduce(out: dict[str, Any]) -> None:
            torch.distributed.all_reduce(out["loss"], group=dp_group)
            out["loss"] /= dp

        name = f"tp2dp2/{style}"
        unwrapped = _build(cfg)
        params = _params(unwrapped)
        ddp = DistributedDataParallel(cfg, ddp_config, unwrapped)
        twin = run(ddp)
        reduce(twin)

        def layout(ref: dict = ref, twin: dict = twin, params: dict = params, name: str = name) -> str:
            _same("loss", twin["loss"], ref["loss"])
            _same("output columns", twin["y"], ref["y"][:, cols])
            _same("input gradient columns", twin["dx"] / dp, ref["dx"][:, cols])
            sliced = {n: _tp_slice(g, params[n], 2, tp_r) for n, g in ref["grads"].items()}
            return _compare(name, twin["grads"], sliced)

        check(record, f"{name}/layout", layout)
        wrapped = DistributedDataParallel(cfg, ddp_config, _build(cfg, like=unwrapped))

        def run_inner(model: Any, ddp: Any = wrapped, run: Any = run) -> dict:
            return run(ddp)  # memo wraps the block inside DDP; DDP runs the step

        check(record, f"{name}/memo/build", lambda: None)
        _wrapped_runs(record, name, wrapped.module, run_inner, twin, reduce)

    # Ulysses over all four ranks: GPT's 4 key/value heads split one a rank, Llama's 2 sent twice each.
    _init(cp=4)
    _context_parallel_layouts(record, "cp4a2a", cp4_refs, cp_comm="a2a", blackbox=False)
    parallel_state.destroy_model_parallel()

    # memo train's pipeline over four ranks (NOTE [Pipelined steps]): two stages of a TP=2 + SP pair.
    from tests.distributed.test_pipeline_parallel import pipelined_train

    check(record, "train/pp2tp2sp", lambda: pipelined_train(pipeline_parallel=2, tensor_parallel=2,
                                                            sequence_parallel=True))


def raising_worker(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    """Rank 1 raises; rank 0 waits in a collective for a rank that will never come."""
    record("started", True, "")
    if rank == 1:
        raise RuntimeError("worker failure injected on rank 1")
    torch.distributed.barrier()


def sleeping_worker(rank: int, world: int, spec: dict[str, Any], record: Any) -> None:
    record("started", True, "")
    import time

    time.sleep(600)


# ----------------------------------------------------------------------------- test side


def _launch(worker: str, world: int, timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    return dist_harness.launch_table(f"{MODULE}:{worker}", world, timeout_s)


@pytest.fixture(scope="module")
def world2() -> dict[str, list[dict[str, Any]]]:
    return _launch("layouts_world2", 2, timeout_s=240)


@pytest.fixture(scope="module")
def world4() -> dict[str, list[dict[str, Any]]]:
    return _launch("ddp_world4", 4, timeout_s=300)


def _assert_passed(table: dict[str, list[dict[str, Any]]], name: str, world: int) -> None:
    dist_harness.assert_passed(table, name, world)


def test_memo_train_under_ulysses_cp2_plans_what_it_measures(world2) -> None:
    """``memo train --engine megatron --cp 2 --cp-comm a2a``: each rank's plan device total within 3% of
    its measured peak (NOTE [Ulysses context parallelism])."""
    _assert_passed(world2, "train/cp2a2a", 2)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", ["tp2sp", "cp2", "cp2a2a"])
def test_layout_matches_single_process(world2, layout: str, style: str) -> None:
    """The unwrapped layers in the layout compute what one process computes on the whole sequence."""
    _assert_passed(world2, f"{layout}/{style}/layout", 2)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", ["tp2sp", "cp2", "cp2a2a"])
def test_memo_matches_unwrapped_in_layout(world2, layout: str, style: str, alpha: float) -> None:
    _assert_passed(world2, f"{layout}/{style}/memo/build", 2)
    _assert_passed(world2, f"{layout}/{style}/memo/alpha={alpha}", 2)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", ["tp2sp", "cp2"])
def test_a_black_box_core_attention_in_layout(world2, layout: str, style: str, alpha: float) -> None:
    """NOTE [Black-box core attention]: a core attention memo does not know (the test's own, context
    parallel for cp2) runs as the layer's, recomputed chunks of 2 tokens around it, and gives what
    memo's attention and the unwrapped layers give."""
    _assert_passed(world2, f"{layout}/{style}/blackbox/memo/alpha={alpha}", 2)


@pytest.mark.parametrize("style", STYLES)
def test_ddp_layout_matches_single_process(world4, style: str) -> None:
    _assert_passed(world4, f"tp2dp2/{style}/layout", 4)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("style", STYLES)
def test_memo_under_ddp_matches_unwrapped(world4, style: str, alpha: float) -> None:
    _assert_passed(world4, f"tp2dp2/{style}/memo/alpha={alpha}", 4)


@pytest.mark.parametrize("style", STYLES)
def test_ulysses_cp4_matches_single_process(world4, style: str) -> None:
    """NOTE [Ulysses context parallelism] over four ranks: GPT's key/value heads split, Llama's
    (2 for 4 ranks) replicated; memo's attention in the unwrapped layers gives the single-process run."""
    _assert_passed(world4, f"cp4a2a/{style}/memo/build", 4)
    _assert_passed(world4, f"cp4a2a/{style}/layout", 4)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("style", STYLES)
def test_memo_under_ulysses_cp4_matches_unwrapped(world4, style: str, alpha: float) -> None:
    _assert_passed(world4, f"cp4a2a/{style}/memo/alpha={alpha}", 4)


def test_memo_train_pipelined_with_tp2_sp_gives_the_single_process_losses(world4) -> None:
    """``memo train --engine megatron --pp 2 --tp 2 --sp --micro-batches 4`` on four ranks: the
    single-process losses (1e-5), every stage's ranks reported, both stages' TP pairs offloading or not
    alike."""
    import json

    from tests.distributed.test_pipeline_parallel import assert_stage_plans_hold, pipelined_losses

    _assert_passed(world4, "train/pp2tp2sp", 4)
    want = pipelined_losses()
    for rec in world4["train/pp2tp2sp"]:
        run = json.loads(rec["detail"])
        assert run["losses"] == pytest.approx(want, rel=1e-5), (run["losses"], want)
        assert sorted(r["pp_rank"] for r in run["ranks"]) == [0, 0, 1, 1]
        first = [r for r in run["ranks"] if r["pp_rank"] == 0]
        assert all(r["host_pinned_bytes"] > 0 for r in first), first
        assert_stage_plans_hold(run["ranks"])


def test_a_failing_rank_ends_the_launch() -> None:
    """A rank that raises ends the launch at once with its error; the rank waiting in a collective is
    terminated, not waited for."""
    import time

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="worker failure injected on rank 1") as e:
        dist_harness.launch(f"{MODULE}:raising_worker", 2, {}, timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert [r["name"] for r in e.value.results[1]] == ["started", "<raised>"]
    assert "worker failure injected" in e.value.results[1][1]["detail"]


def test_a_hanging_launch_is_terminated_at_its_deadline() -> None:
    with pytest.raises(LaunchError, match="deadline") as e:
        dist_harness.launch(f"{MODULE}:sleeping_worker", 2, {}, timeout_s=2)
    # What the ranks recorded before the deadline comes back; a rank that had started records nothing
    # past "started" (it hangs). On a loaded machine a rank may not have started within 2 s: the
    # deadline, not the start-up time, is what is checked.
    assert len(e.value.results) == 2
    assert all(not recs or [r["name"] for r in recs] == ["started"] for recs in e.value.results)


def test_cpu_shims_patch_nothing_where_cuda_is_usable(monkeypatch) -> None:
    """On a CUDA machine megatron's own code paths are the right ones: install_cpu_shims changes nothing."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    from memo.distributed import cpu_shims

    # An in-process megatron build earlier in this worker (memo.engines.init_megatron_world) may have
    # left them installed: start from megatron's own functions and leave the process as it was found.
    had_shims = cpu_shims.cpu_shims_installed()
    cpu_shims.remove_cpu_shims()
    try:
        _check_shims_patch_only_without_cuda(monkeypatch, fused_softmax, mrandom, cpu_shims)
    finally:
        if had_shims:
            cpu_shims.install_cpu_shims()


def _check_shims_patch_only_without_cuda(monkeypatch: Any, fused_softmax: Any, mrandom: Any,
                                         cpu_shims: Any) -> None:
    watched = [(torch.cuda, "current_device"), (mrandom, "_get_cuda_rng_state"),
               (mrandom, "_set_cuda_rng_state"), (mrandom.CudaRNGStatesTracker, "add"),
               (mrandom.CudaRNGStatesTracker, "fork"), (fused_softmax, "get_default_causal_mask")]
    before = [getattr(o, n) for o, n in watched]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_shims.install_cpu_shims()
    assert not cpu_shims.cpu_shims_installed()
    assert [getattr(o, n) for o, n in watched] == before
    monkeypatch.undo()
    try:  # without CUDA: patched, idempotent, and removable
        cpu_shims.install_cpu_shims()
        cpu_shims.install_cpu_shims()
        assert cpu_shims.cpu_shims_installed() and torch.cuda.current_device() == torch.device("cpu")
        assert sum(getattr(o, n) is not b for (o, n), b in zip(watched, before, strict=True)) == len(watched)
    finally:
        cpu_shims.remove_cpu_shims()
    assert [getattr(o, n) for o, n in watched] == before


def test_sequence_parallel_norms_mark_their_parameters() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from memo.adapters.megatron import get_memo_gpt_layer_local_spec
    from memo.distributed.cpu_shims import TorchNorm, sequence_parallel_norms

    layer = get_memo_gpt_layer_local_spec()
    cfg = _config("llama", tp=1)
    cfg.sequence_parallel = True
    block = sequence_parallel_norms(layer, cfg)
    assert layer.submodules.input_layernorm is WrappedTorchNorm  # the given spec is not changed
    assert len(block.layer_specs) == LAYERS and block.layer_norm is TorchNorm
    assert block.layer_specs[0].submodules.input_layernorm is TorchNorm
    assert block.layer_specs[0].submodules.pre_mlp_layernorm is TorchNorm
    norm = TorchNorm(cfg, HIDDEN)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
