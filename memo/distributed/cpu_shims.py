"""CPU shims for megatron-core 0.16.1: its parallel layers and DDP in several CPU processes over gloo.

Used only on CPU (the multi-process tests, tests/distributed/test_distributed.py): megatron-core's tensor
parallel (TP), sequence parallel (SP), context parallel (CP) layers and its
``DistributedDataParallel`` (``finalize_model_grads``, ``overlap_grad_reduce``,
``use_distributed_optimizer``) run on CPU with gloo and give the single-process gradients once
a few places that hard-code CUDA answer the CPU instead. :func:`install_cpu_shims` applies them,
and only when ``torch.cuda.is_available()`` is False: on a CUDA machine megatron's own code
paths are the right ones and nothing is patched. Each patch has a NOTE below saying why.

What the shims do not cover, and what to do instead:

- ``get_megatron_optimizer`` and ``clip_grads`` hard-code CUDA: use a ``torch.optim``
  optimizer on the parameters (with ``use_distributed_optimizer=True`` each data-parallel rank
  owns one shard of every bucket's reduced gradients, see megatron's ``shard_buffer``).
- megatron's context parallelism is wired into TransformerEngine's attention only: on CPU the
  core attention must all-gather K/V over the CP group itself (memo's does).
- the local spec's torch norm (``WrappedTorchNorm``) refuses sequence parallelism on any
  device: :func:`sequence_parallel_norms` builds a block spec whose norms accept it
  (:class:`TorchNorm`); this part is not CPU-specific.

Usage, in every process, after ``torch.distributed.init_process_group("gloo", ...)``::

    from memo.distributed.cpu_shims import install_cpu_shims, sequence_parallel_norms
    install_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)          # the RNG tracker, now on the CPU generator
    spec = sequence_parallel_norms(get_memo_gpt_layer_local_spec(), config)
    block = TransformerBlock(config, spec=spec)
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "TorchNorm",
    "cpu_shims_installed",
    "install_cpu_shims",
    "remove_cpu_shims",
    "sequence_parallel_norms",
]

# (owner, attribute name, original value) of every patch applied, in order; empty when none is.
_PATCHED: list[tuple[object, str, object]] = []


def cpu_shims_installed() -> bool:
    """Whether :func:`install_cpu_shims` has patched this process (and :func:`remove_cpu_shims` not since)."""
    return bool(_PATCHED)


def install_cpu_shims() -> None:
    """Patch megatron-core 0.16.1 (and ``torch.cuda.current_device``) to run on CPU. Idempotent.

    Does nothing when ``torch.cuda.is_available()``: the shims exist for machines without CUDA.
    :func:`remove_cpu_shims` undoes them.
    """
    if torch.cuda.is_available() or _PATCHED:
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as mutils

    # NOTE [CPU current device]: megatron allocates its global memory buffer (TP and SP
    # all-gathers), the sequence-parallel gather/scatter outputs and DDP's grad buffers with
    # ``device=torch.cuda.current_device()``; without CUDA that call raises. The CPU device is
    # the device every tensor lives on here. memo's own calls are guarded by device.type == "cuda".
    _patch(torch.cuda, "current_device", _cpu_current_device)

    # NOTE [CPU RNG tracker]: megatron's RNG tracker (``get_cuda_rng_tracker``) keeps named CUDA
    # generator states and swaps them in ``fork()``: the TransformerBlock forks it around its
    # layers under sequence parallelism, TP weight init and attention dropout fork it too. On
    # CPU every random draw comes from the CPU generator, so the tracker must save, seed and
    # swap that one; otherwise ``torch.cuda.get_rng_state`` raises, and ``_set_cuda_rng_state``
    # would queue a lazy CUDA call that never runs (the fork would silently not happen).
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    _patch(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add)
    _patch(mrandom.CudaRNGStatesTracker, "fork", _cpu_tracker_fork)

    # NOTE [CPU causal mask]: megatron's DotProductAttention, given attention_mask=None for a
    # causal layer, builds the mask with ``get_default_causal_mask``, which allocates on "cuda".
    # fused_softmax imported the function by name, so both names are patched.
    _patch(mutils, "get_default_causal_mask", _cpu_causal_mask)
    _patch(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)

    # NOTE [CPU context-parallel RoPE rows]: under CP megatron's RotaryEmbedding keeps the table
    # rows of this rank's positions (load-balanced causal layout: chunks r and 2c-1-r of 2c) with
    # ``get_pos_emb_on_this_cp_rank``, which builds its index in pinned memory and moves it to
    # CUDA. Three modules imported it by name.
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        _patch(module, "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank)

    # NOTE [CPU pipeline schedules]: every schedule of megatron's pipeline_parallel/schedules.py
    # (no pipelining, 1F1B, interleaved) starts its token count with ``torch.zeros(..., device="cuda")``.
    # The module's ``torch`` is given a stand-in that reads "cuda" as the CPU in ``zeros`` and is torch
    # for everything else. (Its p2p communication allocates on ``torch.cuda.current_device()``, patched
    # above; batched p2p is off under gloo: NOTE [Batched p2p under gloo] in memo/distributed/pipeline.py.)
    from megatron.core.pipeline_parallel import schedules

    _patch(schedules, "torch", _CpuTorch(schedules.torch))


def remove_cpu_shims() -> None:
    """Restore everything :func:`install_cpu_shims` patched (in reverse order). Idempotent."""
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)


def _patch(owner: object, name: str, value: object) -> None:
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


class _CpuTorch:
    """``torch`` whose ``zeros`` puts a tensor asked for on "cuda" on the CPU (NOTE [CPU pipeline
    schedules])."""

    def __init__(self, real: types.ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def zeros(self, *args: object, **kwargs: object) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return self._real.zeros(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_get_rng_state(device: int | str | torch.device = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # a new tensor already: ``clone`` changes nothing


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self: CudaRNGStatesTracker, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on the CPU generator: a state seeded with ``seed`` under ``name``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")  # megatron's own message and type
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def _cpu_tracker_fork(self: CudaRNGStatesTracker, name: str = "model-parallel-rng") -> Iterator[None]:
    """``CudaRNGStatesTracker.fork`` on the CPU generator. megatron's version also warns when the CPU
    state changed inside the fork; here the CPU generator *is* the forked one, so there is no warning."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same as the "
                            f"desired state name {name}.")
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(self.states_[orig_name] if orig_name != "default-rng" else orig)
        self._current_state_name = orig_name


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int,
                                 cp_group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    """megatron's ``get_pos_emb_on_this_cp_rank`` with a CPU index: rows of chunks r and 2c-1-r."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    c, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * c, -1, *pos_emb.shape[seq_dim + 1:])
    picked = chunks.index_select(seq_dim, torch.tensor([r, 2 * c - r - 1]))
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


class TorchNorm:
    """megatron's ``WrappedTorchNorm`` (``torch.nn.LayerNorm`` / ``RMSNorm`` per ``config.normalization``)
    that accepts sequence parallelism.

    NOTE [Sequence-parallel norm]: under SP each TP rank normalizes its own tokens with the
    full (replicated) weights, so a norm's weight gradient is a partial sum over tokens that
    megatron all-reduces over the TP group: ``finalize_model_grads`` does it for parameters that
    carry ``.sequence_parallel=True``, as TENorm and FusedLayerNorm set them. ``WrappedTorchNorm``
    only asserts that SP is off; this one marks its parameters instead.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        from memo.errors import MemoError

        unsupported = ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm")
        on = [name for name in unsupported if getattr(config, name, False)]
        if on:
            raise MemoError(f"memo.distributed.TorchNorm: {', '.join(on)} not supported by torch's norms; "
                            "turn them off")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise MemoError(f"memo.distributed.TorchNorm: normalization={config.normalization!r}, expected "
                            f"one of {sorted(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def sequence_parallel_norms(layer_spec: ModuleSpec, config: TransformerConfig) -> TransformerBlockSubmodules:
    """A TransformerBlock spec whose norms accept sequence parallelism (NOTE [Sequence-parallel norm]).

    ``layer_spec``: a TransformerLayer ``ModuleSpec`` (e.g. ``get_memo_gpt_layer_local_spec()``); a
    copy of it gets :class:`TorchNorm` wherever it had megatron's ``WrappedTorchNorm`` (input,
    pre-MLP, q/k norms). Returns ``TransformerBlockSubmodules`` with as many layers as megatron's
    ``get_num_layers_to_build(config)`` (``config.num_layers`` without pipeline parallelism) and a
    :class:`TorchNorm` final norm: pass it as ``TransformerBlock(config, spec=...)`` or
    ``GPTModel(transformer_layer_spec=...)``.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from memo.errors import MemoError

    spec = copy.deepcopy(layer_spec)
    subs = getattr(spec, "submodules", None)
    if subs is None or not hasattr(subs, "input_layernorm"):
        raise MemoError("memo.distributed.sequence_parallel_norms: expected a TransformerLayer ModuleSpec "
                        f"(with submodules.input_layernorm), got {type(layer_spec).__name__}")
    holders = [subs, getattr(getattr(subs, "self_attention", None), "submodules", None)]
    for holder in holders:
        for field in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
            if holder is not None and getattr(holder, field, None) is WrappedTorchNorm:
                setattr(holder, field, TorchNorm)
    if config.pipeline_model_parallel_size == 1 and config.pipeline_model_parallel_layout is None:
        n = config.num_layers  # what get_num_layers_to_build answers, without megatron's parallel state
    else:
        n = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=TorchNorm)
