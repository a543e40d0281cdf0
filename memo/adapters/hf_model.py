"""Hugging Face causal LMs as a whole: memo's model adapter for ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` and ``MistralForCausalLM`` (NOTE [Model adapters] in memo/adapters/model.py);
their decoder layers' adapter is in memo/adapters/hf.py."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from memo.adapters.hf import _CHECKPOINTING_OFF, SUPPORTED_ATTENTION
from memo.adapters.hf_packed import use_packed_attention
from memo.adapters.model import ModelAdapter, ModelParts
from memo.errors import MemoError
from memo.models.loss import IGNORE_INDEX

__all__ = ["CausalLMAdapter"]


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


_TRANSFORMERS_MAJOR = int(_transformers_version().split(".")[0])


class _ChunkedLossHead(nn.Module):
    """The LM head and mean cross-entropy of an HF causal LM, chunked over tokens so that the
    ``[b, s, V]`` logits never exist: ``(h [b, s, H] after the final norm, labels [b, s]) -> loss``.

    Holds the model weakly and reads ``model.lm_head`` at each call (so a resized head is used); it is
    not a submodule of the model, so the model's state dict is unchanged. Under autocast the head
    runs in the autocast dtype, as HF's ``nn.Linear`` head does.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self._model = weakref.ref(model)
        self.chunk_tokens = chunk_tokens

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from memo.models.loss import chunked_lm_loss

        model = self._model()
        if model is None:
            raise MemoError("memo.adapters.hf: the model of this loss head was freed")
        weight = model.lm_head.weight
        device = h.device.type
        if torch.is_autocast_enabled(device):
            dt = torch.get_autocast_dtype(device)
            h, weight = h.to(dt), weight.to(dt)
        # chunked_lm_loss walks tokens in x's row-major order with labels transposed the same way;
        # passing the batch-first h as "[b, s, H]" with labels.t() keeps h contiguous (no copy).
        return chunked_lm_loss(h, weight, labels.t(), self.chunk_tokens)


class CausalLMAdapter(ModelAdapter):
    """``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``: ``model.model.embed_tokens``,
    ``model.model.layers``, and a head of ``model.model.norm`` plus a chunked LM loss against
    ``model.lm_head.weight`` (NOTE [Model adapters])."""

    name = "hf-causal-lm"
    masks_documents = True  # transformers masks by position-id resets (NOTE [HF attention masks])

    def __init__(self) -> None:
        self._heads: weakref.WeakKeyDictionary[nn.Module, _ChunkedLossHead] = weakref.WeakKeyDictionary()

    def loss_head(self, model: nn.Module) -> nn.Module:
        """The module computing ``model``'s loss from its final hidden states (the last head part)."""
        head = self._heads.get(model)
        if head is None:
            head = self._heads[model] = _ChunkedLossHead(model)
        return head

    def check(self, model: nn.Module) -> None:
        where = f"memo.adapters.hf: {type(model).__name__}"
        problems = []
        base = getattr(model, "model", None)
        for name in ("embed_tokens", "layers", "norm"):
            if getattr(base, name, None) is None:
                problems.append(f"it has no model.{name}")
        head = getattr(model, "lm_head", None)
        if not isinstance(head, nn.Linear):
            problems.append(f"its lm_head is {type(head).__name__}, not an nn.Linear")
        elif head.bias is not None:
            problems.append("its lm_head has a bias (memo's chunked loss has none)")
        cfg = getattr(model, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                problems.append(f"config.{attr}={getattr(cfg, attr)} changes the logits")
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            problems.append(f"HF gradient checkpointing is on ({_CHECKPOINTING_OFF})")
        impl = getattr(cfg, "_attn_implementation", None)
        if impl not in SUPPORTED_ATTENTION:
            problems.append(f"its attention implementation is {impl!r} (memo reproduces 'eager' and 'sdpa': "
                            "load the model with attn_implementation='sdpa')")
        if problems:
            raise MemoError(f"{where}: " + "; ".join(problems))

    def parts(self, model: nn.Module) -> ModelParts:
        base = model.model
        return ModelParts(base.embed_tokens, list(base.layers), [base.norm, self.loss_head(model)])

    def targets(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """HF's labels (``model(input_ids, labels=labels)``: the model shifts them) as the token
        each position predicts: ``labels[:, 1:]``, the last position ignored, as HF's causal-LM
        loss does (NOTE [Labels in the model's convention] in memo/session.py)."""
        ignore = torch.full_like(labels[:, :1], IGNORE_INDEX)
        return torch.cat([labels[:, 1:], ignore], dim=1)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token loss; ``labels[:, t]`` is the target of position t (already shifted, -100
        ignored). Runs the base model (embedding, layers, final norm), then the chunked head.
        ``positions``: ``[b, s]`` position ids of packed documents (a position that does not follow its
        predecessor starts a document): the model is switched to memo's packed attention, which attends
        within each document with no ``[s, s]`` mask (NOTE [Packed attention in HF models] in
        memo/adapters/hf_packed.py)."""
        if ids.device.type == "meta":
            raise MemoError(
                f"memo.adapters.hf: {type(model).__name__} cannot run on the meta device: transformers "
                "prepares its attention mask from tensor values (e.g. packed-sequence detection in "
                "position_ids). Profile Hugging Face models on cpu or cuda")
        if positions is not None and _TRANSFORMERS_MAJOR < 5:
            raise MemoError(f"memo.adapters.hf: packed documents need transformers >= 5, which builds the "
                            f"block-causal mask from position ids; this is {_transformers_version()}")
        if positions is not None:  # NOTE [Packed attention in HF models] in memo/adapters/hf_packed.py
            use_packed_attention(model)
        out = model.model(input_ids=ids, use_cache=False,
                          **({} if positions is None else {"position_ids": positions}))
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        return self.loss_head(model)(hidden, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.lm_head.weight.shape[0])
