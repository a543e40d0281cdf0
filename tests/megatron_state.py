"""What an in-process megatron run leaves behind, removed after it. Not a test module (no ``test_``
prefix).

``memo.engines.init_megatron_world`` sets up a world of one in the calling process (a gloo process group,
megatron-core's parallel state, the CPU shims): right for ``memo train``, which then exits, but a pytest
worker goes on to other test files, some of which set up their own ("data parallel group is already
initialized")."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def megatron_state_restored() -> Iterator[None]:
    """Run the body, then tear down the process group, megatron's parallel state and the CPU shims it
    set up (what existed before is left)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns on import that TransformerEngine and Apex are absent
        from megatron.core import parallel_state

    from memo.distributed import cpu_shims

    had_group, had_shims = torch.distributed.is_initialized(), cpu_shims.cpu_shims_installed()
    had_parallel = parallel_state.model_parallel_is_initialized()
    try:
        yield
    finally:
        if not had_parallel and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if not had_shims:
            cpu_shims.remove_cpu_shims()
