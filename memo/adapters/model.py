"""Model adapters: where a model keeps its embedding, its layer stack and its head, and its loss.

NOTE [Model adapters]
memo's layer adapters (NOTE [Layer adapters]) say how one layer splits into pre / core / post.
Profiling, planning and training also need the model around the layers: which module opens each
phase of an iteration (NOTE [Phase boundaries] in memo/phases.py), and how to get a loss from a
batch of token ids. A :class:`ModelAdapter` says exactly that, for one family of models:

- ``parts(model) -> ModelParts``: the embedding module (phase ``embed``), the layers in forward
  order (``layer.fwd[i]``), and the head modules (``head``: the final norm, the LM head or the
  module that computes the loss from the last hidden states; one phase from the first one's
  forward to the last one's);
- ``loss(model, ids, labels) -> loss``: ``ids, labels: [b, s]`` int64, where ``labels[:, t]`` is the
  token that should follow ``ids[:, t]`` (memo's convention: already shifted; ``-100`` is ignored),
  and the loss is the mean over the counted tokens; an adapter whose ``masks_documents`` is True also
  takes ``positions: [b, s]`` int64, each token's position in its own document (packed documents,
  NOTE [Packed documents] in memo/train/corpus.py): a reset of the positions starts a document, and no
  token attends across one (:func:`adapter_loss` refuses positions to the others);
- ``vocab_size(model)`` and ``check(model)`` (refuse, with the reason, a configuration the adapter
  cannot profile or train, e.g. gradient checkpointing already turned on).

Adapters are registered by the qualified name of the model class, so that registering the
Hugging Face or megatron-core adapters imports neither library; :func:`find_model_adapter`
walks the model's class hierarchy and loads the adapter the first time it is asked for.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from memo.adapters._lazy import AdapterRegistry, qualname
from memo.errors import MemoError

__all__ = ["MemoModelAdapter", "ModelAdapter", "ModelParts", "adapter_loss", "find_model_adapter",
           "model_adapter_for", "use_model_adapter", "with_positions",
           "register_model_adapter", "registered_model_adapters", "unregister_model_adapter"]


@dataclass(frozen=True)
class ModelParts:
    """The modules of one model that open its phases (NOTE [Model adapters])."""

    embedding: nn.Module
    layers: list[nn.Module]
    head: list[nn.Module]


class ModelAdapter:
    """Where a family of models keeps its parts, and how it computes the loss (NOTE [Model adapters])."""

    #: Short name for messages and reports.
    name: str = "model"
    #: Whether :meth:`loss` takes ``positions`` and keeps packed documents apart (NOTE [Model adapters]).
    masks_documents: bool = False

    def check(self, model: nn.Module) -> None:
        """Raise :class:`MemoError` when memo cannot profile or train this model as configured."""

    def parts(self, model: nn.Module) -> ModelParts:
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define parts()")

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define loss()")

    def targets(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` in the model's own convention as :meth:`loss` takes them: the token each
        position predicts (NOTE [Labels in the model's convention]). memo's models take them so
        already; a library that shifts its labels inside the model (HF) shifts them here."""
        return labels

    def vocab_size(self, model: nn.Module) -> int:
        raise MemoError(f"memo.adapters: {type(self).__name__} does not define vocab_size()")


class MemoModelAdapter(ModelAdapter):
    """memo's own models (:class:`memo.models.model.TransformerModel`): ``.embedding``, ``.layers``,
    ``.head`` (the final norm and the chunked LM loss) and ``model(ids, labels) -> loss``."""

    name = "memo"

    def parts(self, model: nn.Module) -> ModelParts:
        return ModelParts(model.embedding, list(model.layers), [model.head])

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:
            raise _no_document_masking(self, type(model).__name__)
        return model(ids, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.config.vocab_size)


def adapter_loss(adapter: ModelAdapter, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """``adapter.loss``, with ``positions`` (packed documents) only for an adapter that masks documents,
    else a MemoError: a model without document masking would attend across the documents."""
    if positions is None:
        return adapter.loss(model, ids, labels)
    if not adapter.masks_documents:
        raise _no_document_masking(adapter, type(model).__name__)
    return adapter.loss(model, ids, labels, positions)


def _no_document_masking(adapter: ModelAdapter, model_name: str) -> MemoError:
    return MemoError(f"memo.adapters: the {adapter.name} model adapter ({model_name}) does not mask "
                     "attention at document boundaries, so packed documents would attend to each other; "
                     "train packed data on a Hugging Face causal LM, or one document per sequence")


class _ExamplePositions(ModelAdapter):
    """``base`` with an example batch's positions as the default of its loss (:func:`with_positions`)."""

    masks_documents = True

    def __init__(self, base: ModelAdapter, positions: torch.Tensor) -> None:
        self.base, self.positions, self.name = base, positions, base.name

    def check(self, model: nn.Module) -> None:
        self.base.check(model)

    def parts(self, model: nn.Module) -> ModelParts:
        return self.base.parts(model)

    def loss(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        return adapter_loss(self.base, model, ids, labels, self.positions if positions is None else positions)

    def targets(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return self.base.targets(model, labels)

    def vocab_size(self, model: nn.Module) -> int:
        return self.base.vocab_size(model)


def with_positions(adapter: ModelAdapter, positions: torch.Tensor) -> ModelAdapter:
    """``adapter`` whose loss without positions uses ``positions`` (an example batch's packed documents),
    for :func:`use_model_adapter`: memo's profile, which calls ``loss(model, ids, labels)``, then records
    the iteration a packed step runs; a step passes its own positions."""
    if not adapter.masks_documents:
        raise _no_document_masking(adapter, "its model")
    return _ExamplePositions(adapter, positions)


#: Qualified class name -> the adapter, or ``"module:attribute"`` to import on first use (other
#: libraries' adapters are registered here by name, so that memo imports them only when needed).
_REGISTRY: AdapterRegistry[ModelAdapter] = AdapterRegistry(ModelAdapter, "model adapter", {
    "memo.models.model.TransformerModel": MemoModelAdapter(),
    "megatron.core.models.gpt.gpt_model.GPTModel": "memo.adapters.megatron:GPTModelAdapter",
    "transformers.models.llama.modeling_llama.LlamaForCausalLM": "memo.adapters.hf_model:CausalLMAdapter",
    "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM": "memo.adapters.hf_model:CausalLMAdapter",
    "transformers.models.mistral.modeling_mistral.MistralForCausalLM":
        "memo.adapters.hf_model:CausalLMAdapter",
})


def register_model_adapter(model_class: type | str, adapter: ModelAdapter | str) -> None:
    """Use ``adapter`` for ``model_class`` and its subclasses. Either may be given by name: a class as
    ``"package.module.Class"``, an adapter as ``"package.module:attribute"`` (imported on first use)."""
    key = model_class if isinstance(model_class, str) else qualname(model_class)
    if not isinstance(adapter, (ModelAdapter, str)):
        raise MemoError(f"memo.adapters: a model adapter is a ModelAdapter or 'module:attribute', got "
                        f"{type(adapter).__name__}")
    _REGISTRY.register(key, adapter)


def unregister_model_adapter(model_class: type | str) -> None:
    _REGISTRY.unregister(model_class if isinstance(model_class, str) else qualname(model_class))


def registered_model_adapters() -> dict[str, ModelAdapter | str]:
    return dict(_REGISTRY.entries)


#: Adapters given for one model instance (:func:`use_model_adapter`), before any class's.
_INSTANCES: weakref.WeakKeyDictionary[nn.Module, ModelAdapter] = weakref.WeakKeyDictionary()


def use_model_adapter(model: nn.Module, adapter: ModelAdapter | None) -> None:
    """Serve this one ``model`` with ``adapter`` (None: its class's again). A training loop whose loss
    is not the class's (one rank of a parallel job: its shard's positions, the global batch's
    mean) gives the profile the loss each step runs, so that the recorded iteration is the step's."""
    if adapter is None:
        _INSTANCES.pop(model, None)
    elif isinstance(adapter, ModelAdapter):
        _INSTANCES[model] = adapter
    else:
        raise MemoError("memo.adapters: use_model_adapter needs a ModelAdapter, got "
                        f"{type(adapter).__name__}")


def find_model_adapter(model: nn.Module) -> ModelAdapter | None:
    """The adapter given for this model (:func:`use_model_adapter`), else the one registered for its
    class or its nearest registered base class."""
    mine = _INSTANCES.get(model)
    if mine is not None:
        return mine
    return _REGISTRY.find(type(model))


def model_adapter_for(model: nn.Module, what: str = "memo") -> ModelAdapter:
    """:func:`find_model_adapter`, checked; else a MemoError naming the class and what to write."""
    adapter = find_model_adapter(model)
    if adapter is None:
        name = qualname(type(model))
        known = ", ".join(sorted(k.rsplit(".", 1)[-1] for k in _REGISTRY.entries))
        raise MemoError(
            f"{what}: no model adapter for {name}; memo knows {known}. Write a memo.adapters.ModelAdapter "
            "(parts: the embedding, the layers and the head modules; loss(model, ids, labels)) and "
            f"register it with memo.adapters.register_model_adapter({type(model).__name__}, YourAdapter())")
    adapter.check(model)
    return adapter

