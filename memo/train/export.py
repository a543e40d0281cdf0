"""``memo train --export DIR``: the trained Hugging Face model written with ``save_pretrained`` at the end
of training, where ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it back.

NOTE [Exporting the trained model]
- What: the model's own state dict (memo's wrapping changes no module names, NOTE [Wrapping in place]
  in memo/runtime/wrap.py; FSDP2's root is a module around the model, NOTE [FSDP2's root is the loss]
  in memo/distributed/fsdp2.py, and the model's own keys are taken below it), written by the model's
  ``save_pretrained`` as safetensors with its config.json (the rope parameters it trained with, NOTE
  [Context extension] in memo/engines.py) and generation config, plus the tokenizer files of the
  ``--hf-model`` checkpoint where it has them. Every tensor is the trained one, in the training dtype.
- Under FSDP2 (any placement: sharded, in host memory with ``--offload-states``, with Ulysses CP)
  every rank takes part in gathering the full state dict
  (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict`` and
  ``cpu_offload``: rank 0 receives each tensor, in host memory, one at a time) and rank 0 writes.
- Whole or not at all: rank 0 writes into a new directory beside DIR and renames it to DIR when
  everything is written, so a run that dies while exporting leaves no DIR that looks complete. DIR
  must be new or empty, and no input of the run (refused before training starts).
- megatron's GPTModel (``--engine megatron``, from ``--hf-model`` or memo's llama-arch models) is
  converted back: every rank takes part in gathering its tensor-parallel shards to the first rank of its
  TP group, and rank 0 inverts the converter (NOTE [Hugging Face weights in megatron's layout] in
  memo/adapters/megatron_hf.py: the query groups split into q/k/v, the gate and up halves of every
  rank's ``linear_fc1`` joined, the padded vocabulary rows cut) into a transformers model of the
  checkpoint's config (rope flags included), or of a ``LlamaConfig`` (``Qwen3Config`` with q/k norms)
  made from memo's config, and writes it with ``save_pretrained``.
- memo's reference models have their own parameter layout (fused QKV), which no transformers class
  loads as it is: not exported. ``memo train`` has no adapters (LoRA) to merge.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from memo.errors import MemoError

if TYPE_CHECKING:
    from memo.distributed.layout import ParallelRun

__all__ = ["TOKENIZER_FILES", "check_export_path", "export_trained", "full_state_dict"]

#: The files of a Hugging Face tokenizer that an export copies from the ``--hf-model`` checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


def check_export_path(path: str, inputs: list[tuple[str, str | None]]) -> None:
    """Refuse an ``--export`` directory that cannot be written whole, before training (NOTE [Exporting
    the trained model]): one that exists and is not empty, is one of the run's ``inputs`` (``(flag,
    path)``; None: not given) or holds one or lies inside one, or cannot be made."""
    where = f"memo.train: --export {path!r}"
    target = os.path.realpath(path)
    for flag, given in inputs:
        if given is None or not os.path.exists(given):
            continue
        source = os.path.realpath(given)
        if target == source or target.startswith(os.path.join(source, "")) or \
                source.startswith(os.path.join(target, "")):
            raise MemoError(f"{where} is, holds or lies inside the input {flag} {given!r}; give the export "
                            "a directory of its own (nothing was run)")
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise MemoError(f"{where} exists and is not an empty directory; give a new directory (nothing was "
                        "run)")
    existing = os.path.dirname(target)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MemoError(f"{where}: the folder {existing!r} is not writable (nothing was run)")


def full_state_dict(model: torch.nn.Module, parallel: ParallelRun | None) -> dict[str, torch.Tensor]:
    """The model's full state dict in host memory under its own keys: gathered from every rank's shards
    under FSDP2 (a collective: every rank calls it; only rank 0 gets the tensors, the others an empty
    dict), else the model's own tensors."""
    from memo.distributed.fsdp2 import fsdp_modules

    if parallel is not None and fsdp_modules(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    return {name: t.detach().to("cpu") for name, t in model.state_dict().items()}


def export_trained(model: torch.nn.Module, directory: str, parallel: ParallelRun | None = None,
                   tokenizer_from: str | None = None, log: Callable[[str], None] | None = None) -> str | None:
    """Write the trained ``model`` to ``directory`` (NOTE [Exporting the trained model]), with the
    tokenizer files of the checkpoint directory ``tokenizer_from``; every rank of a parallel run calls
    it, rank 0 writes. Returns the directory written (None on the other ranks)."""
    if _is_megatron(model):
        hf_model = _megatron_as_hf(model, parallel)  # a collective over each TP group
        state = None
    else:
        hf_model, state = model, full_state_dict(model, parallel)
    if parallel is not None and not parallel.is_first:
        return None
    target = os.path.abspath(directory)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(target)}.partial-{os.getpid()}")
    if os.path.lexists(partial):  # left by a process of the same id that died while exporting
        shutil.rmtree(partial)
    try:
        os.makedirs(partial)
        hf_model.save_pretrained(partial, state_dict=state)  # type: ignore[union-attr]
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                source = os.path.join(tokenizer_from, name)
                if os.path.isfile(source):
                    shutil.copyfile(source, os.path.join(partial, name))
        try:
            os.rename(partial, target)  # onto a missing or empty directory: atomic on POSIX
        except OSError as err:
            raise MemoError(f"memo.train: --export {directory!r}: the finished export could not be moved "
                            f"there ({err.strerror}); it was left in {partial!r}") from None
    except MemoError:
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if log is not None:
        log(f"memo.train: exported the trained model to {target} (save_pretrained; "
            "transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return target


def _is_megatron(model: torch.nn.Module) -> bool:
    """Whether ``model`` is megatron-core's GPTModel as memo/engines.py builds it."""
    return type(model).__module__.startswith("megatron.") and hasattr(model, "memo_config")


def _megatron_as_hf(model: torch.nn.Module, parallel: ParallelRun | None) -> torch.nn.Module | None:
    """The transformers model holding megatron ``model``'s trained tensors, on rank 0 (None elsewhere):
    its TP shards gathered, the converter inverted (NOTE [Exporting the trained model])."""
    from transformers import AutoModelForCausalLM

    from memo.adapters.megatron_hf import gather_full_state, hf_config_of, hf_state_dict

    full = gather_full_state(model)
    if parallel is not None and not parallel.is_first:
        return None
    config = model.memo_config
    tied = bool(model.share_embeddings_and_output_weights)
    dtype = full["embedding.word_embeddings.weight"].dtype
    hf_config = getattr(model, "hf_config", None) or hf_config_of(config, tied, dtype)
    with torch.device("meta"):  # the tensors are assigned below: nothing is initialised
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf.load_state_dict(hf_state_dict(full, config, tied), strict=True, assign=True)
    return hf
