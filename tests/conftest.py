"""Shared pytest setup: the longest test files first; GPU tests skip without CUDA."""

from __future__ import annotations

import pytest
import torch

#: The test files that take longest under ``make test`` (measured 2026-11-28 with ``--durations=0``
#: on the 2-core machine), longest first. They are collected first: the two xdist workers take one
#: file at a time in collection order (``--dist loadfile --no-loadscope-reorder``), and a long file
#: taken last leaves the other worker idle while it runs. Unlisted files follow in their own order.
LONGEST_FIRST = (
    "tests/benchmarks/test_benchmarks_max_seq_len.py",
    "tests/runtime/test_plan_truth.py",
    "tests/benchmarks/test_benchmarks_smoke.py",
    "tests/estimate/test_estimate_vs_train.py",
    "tests/distributed/test_distributed_train.py",
    "tests/distributed/test_resume.py",
    "tests/estimate/test_estimate_honest.py",
    "tests/estimate/test_estimate.py",
    "tests/train/test_train_example.py",
    "tests/runtime/test_compile.py",
    "tests/distributed/test_distributed.py",
    "tests/benchmarks/test_gpu_bench.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/train/test_checkpoint.py",
    "tests/profiler/test_offload_bytes.py",
    "tests/distributed/test_hf_model_fsdp2.py",
    "tests/pipeline/test_pipeline.py",
    "tests/distributed/test_fsdp2_ulysses.py",
)


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes: one intra-op thread is fastest and immune to an oversubscribed machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def gpt_125m_8k_meta_profile():
    """``memo profile`` of gpt-125m at 8K tokens on the meta device (bf16, the dispatch recorder, a
    machine given so nothing is measured; the bandwidth binds, so 0 < alpha < 1): the job the
    159.6 GiB host arena once appeared in the device trace of. One profile takes seconds; the
    tests that read it (all in tests/profiler/test_offload_bytes.py, so one worker makes it) do not
    change it."""
    import warnings

    from memo.pipeline import profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # gpu="h100": a plan for a GPU, whose tiles are the GPU's (NOTE [Tiles of the device a plan is
        # for] in memo/pipeline/job.py): one 8K tile per layer instead of 32 of the CPU's 256 tokens,
        # so the profile takes seconds instead of a minute.
        return profile("gpt-125m", 8192, 1, dtype="bfloat16", device="meta", recorder="dispatch",
                       bandwidth_gbps=32, layer_ms=3.0, host_mem_gb=64, time_limit=2.0, solver=None,
                       gpu="h100")


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    torch.manual_seed(0)
