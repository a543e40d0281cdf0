"""The pieces of the methods a user would pick instead of memo, written with PyTorch's own APIs.

* :class:`HostBytesMeter` and :func:`host_copy` -- host copies held by saved-tensor hooks, counted.
* :class:`HostOffload` -- a pair of saved-tensor hooks that moves what autograd saves to (pinned)
  host memory and back (NOTE [Offload hooks]).
* :func:`tiled_mlp` / :class:`TiledMLP` -- ALST's tiled MLP (NOTE [Tiled MLP]).
* :func:`find_mlp` -- where a layer computes its MLP (:class:`memo.adapters.MLPSite`).
* :class:`CheckpointedLayers` -- every layer under non-reentrant ``torch.utils.checkpoint``, with
  saved-tensor hooks around each checkpointed call (optional) and the tiled MLP (optional).

The strategies built from them (``offloaded-checkpoint``, ``torchtune-offload``) are in
:mod:`memo.train.strategies`.

NOTE [Offload hooks]
Inside ``torch.utils.checkpoint(..., use_reentrant=False)`` the only tensors packed through the
hooks active *around* the call are the checkpoint's inputs (``_CheckpointFrame.save_inputs`` runs
before checkpoint pushes its own hooks; what the layer saves inside goes to checkpoint's hooks and
is recomputed). A :class:`HostOffload` around a checkpointed layer call therefore moves exactly the
layer input to host: ALST's "checkpointed activations offloaded to CPU". Around a whole forward
(torchtune's ``OffloadActivations``) it moves every saved tensor of at least ``min_bytes`` bytes
that is not a parameter or buffer.

On CUDA a saved tensor goes to pinned host memory with a non-blocking copy and comes back with a
non-blocking copy (what ``save_on_cpu(pin_memory=True)`` does). On the CPU backend ``tensor.cpu()``
moves nothing, so the host copy is made outside memo's device allocator (:func:`host_copy`) and
the way back allocates device memory again: NOTE [save_on_cpu on the CPU backend] in
memo/train/strategies.py. Either way the copies are counted by a :class:`HostBytesMeter`.

NOTE [Tiled MLP]
ALST (arXiv 2506.13996, DeepSpeed's ``TiledMLP``) runs a layer's MLP over token tiles: ``num_shards
= ceil(s / hidden)`` tiles of about ``hidden`` tokens. Forward computes each tile without autograd
and writes it into the output; backward recomputes each tile with autograd and back-propagates the
tile's slice of the output gradient, so the MLP's intermediates (``[tile, 4h]`` and the like) exist
for one tile at a time instead of the whole sequence. The tile's input gradient is written into its
slice of the input gradient; the parameters' gradients are summed over the tiles and returned to
autograd (ALST writes them into ``.grad`` directly; returning them keeps ``torch.autograd.grad`` and
gradient hooks working, for the same memory: one tile's parameter gradients beside the sum).

Recompute replays the state forward ran under: the CPU and device RNG state at the first tile (the
tiles are recomputed in forward's order, so every tile draws the dropout masks it drew in forward)
and the autocast state, as ``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import FunctionCtx

from memo.adapters.base import MLPSite, find_adapter
from memo.errors import MemoError, internal_assert
from memo.repeated_tiles import run_tiles

__all__ = [
    "CheckpointedLayers",
    "HostBytesMeter",
    "HostOffload",
    "MetaHostOffload",
    "TiledMLP",
    "find_mlp",
    "host_copy",
    "mlp_tiles",
    "tiled_mlp",
]


# ---------------------------------------------------------------------------------------- host copies


class HostBytesMeter:
    """Live and peak bytes of the host copies a saved-tensor hook holds.

    A copy counts from the moment it is packed until autograd drops it (after backward used it,
    or when the graph is freed); ``weakref.finalize`` on the host tensor sees that moment.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        #: Tensors copied to host so far, and their bytes.
        self.copies = 0
        self.copied_bytes = 0

    def add(self, host: torch.Tensor) -> None:
        nbytes = host.numel() * host.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.copies += 1
        self.copied_bytes += nbytes
        weakref.finalize(host, self._drop, nbytes)

    def _drop(self, nbytes: int) -> None:
        self.live -= nbytes


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory that memo's CPU allocator does not serve.

    ``torch.frombuffer`` wraps a Python ``bytearray`` without calling c10's CPU allocator, so the
    copy is "host" memory for the emulated device (NOTE [save_on_cpu on the CPU backend]).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return tensor.detach().clone()
    raw = torch.frombuffer(bytearray(nbytes), dtype=torch.uint8)
    host = raw.view(tensor.dtype).view(tensor.shape)
    host.copy_(tensor)
    return host


class HostOffload:
    """Saved-tensor hooks that keep what autograd saves in host memory (NOTE [Offload hooks]).

    ``device``: the training device (cpu or cuda). ``min_bytes``: smaller tensors stay where they are.
    ``skip_parameters``: parameters and buffers stay (torchtune's rule: they live on the device anyway).
    Use ``with offload.hooks(): ...``.
    """

    def __init__(self, device: torch.device, meter: HostBytesMeter | None = None, min_bytes: int = 0,
                 skip_parameters: bool = False) -> None:
        if device.type not in ("cpu", "cuda"):
            raise MemoError(f"memo.train: activation offload runs on cpu or cuda, not {device.type}")
        self.device = device
        self.meter = meter if meter is not None else HostBytesMeter()
        self.min_bytes = int(min_bytes)
        self.skip_parameters = skip_parameters

    def _keeps(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != self.device.type or tensor.layout != torch.strided:
            return True  # already on the host (or not a dense tensor): nothing to move
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return True
        return self.skip_parameters and isinstance(tensor, (nn.Parameter, nn.Buffer))

    def pack(self, tensor: torch.Tensor) -> tuple[bool, Any]:
        if self._keeps(tensor):
            return False, tensor
        if self.device.type == "cuda":
            host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        else:
            host = host_copy(tensor)
        self.meter.add(host)
        return True, (tensor.device, host)

    def unpack(self, packed: tuple[bool, Any]) -> torch.Tensor:
        moved, value = packed
        if not moved:
            return value
        device, host = value
        if device.type == "cuda":
            return host.to(device, non_blocking=True)
        # Back into device memory (memo's allocator), as ``tensor.to(device)`` would on a GPU.
        return host.clone()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class MetaHostOffload:
    """:class:`HostOffload`'s hooks on the meta device, for recording a peer's iteration: a saved
    tensor is counted as host bytes and forgotten on the device (the host copy holds no device
    memory); unpacking allocates it on the device again, as ``host.to(device)`` does on a GPU."""

    def __init__(self) -> None:
        self.live = self.peak = self.copies = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "meta" or isinstance(tensor, nn.Parameter):
            return False, tensor
        n = tensor.numel() * tensor.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        self.copies += 1
        return True, (tuple(tensor.shape), tensor.dtype)

    def unpack(self, packed: Any) -> torch.Tensor:
        moved, value = packed
        if not moved:
            return value
        shape, dtype = value
        return torch.empty(shape, dtype=dtype, device="meta")

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# ---------------------------------------------------------------------------------------- tiled MLP


def mlp_tiles(tokens: int, hidden: int) -> int:
    """ALST's number of MLP tiles for ``tokens`` tokens of width ``hidden``: ``ceil(tokens / hidden)``."""
    return max(1, math.ceil(tokens / hidden))


def _tile_bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    """(start, length) of each tile, the lengths ``torch.chunk`` gives."""
    size = math.ceil(tokens / tiles)
    return [(a, min(size, tokens - a)) for a in range(0, tokens, size)]


class _ReplayState:
    """The RNG and autocast state a forward ran under, to recompute under it (NOTE [Tiled MLP])."""

    def __init__(self, x: torch.Tensor) -> None:
        from torch.utils.checkpoint import _get_autocast_kwargs, get_device_states

        self.device_type = x.device.type
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = ([], []) if self.device_type == "cpu" else get_device_states(x)
        self.device_autocast, self.cpu_autocast = _get_autocast_kwargs(self.device_type)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        from torch.utils.checkpoint import set_device_states

        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            device_autocast = (torch.amp.autocast(self.device_type, **self.device_autocast)
                               if self.device_type != "cpu" and self.device_autocast is not None
                               else contextlib.nullcontext())
            with device_autocast, torch.amp.autocast("cpu", **self.cpu_autocast):
                yield


class _TiledMLPFunction(torch.autograd.Function):
    """``fn`` over token tiles of ``x`` (NOTE [Tiled MLP]); ``params`` are the ones ``fn`` uses."""

    @staticmethod
    def forward(ctx: FunctionCtx, fn: Callable[[torch.Tensor], torch.Tensor], token_dim: int, tiles: int,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.token_dim, ctx.tiles, ctx.params = fn, token_dim, tiles, params
        ctx.state = _ReplayState(x)
        ctx.save_for_backward(x)
        out: torch.Tensor | None = None
        for a, n in run_tiles(_tile_bounds(x.shape[token_dim], tiles)):
            y = fn(x.narrow(token_dim, a, n))
            if not isinstance(y, torch.Tensor) or y.shape[token_dim] != n:
                got = type(y).__name__ if not isinstance(y, torch.Tensor) else f"shape {tuple(y.shape)}"
                raise MemoError(
                    f"memo.train: the tiled MLP's function returned {got} for a tile of {n} tokens along dim "
                    f"{token_dim}; it must return one tensor with the same tokens")
            if out is None:
                shape = list(y.shape)
                shape[token_dim] = x.shape[token_dim]
                out = y.new_empty(shape)
            out.narrow(token_dim, a, n).copy_(y)
            del y
        internal_assert(out is not None, "the tiled MLP ran no tile")
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        dim, params = ctx.token_dim, ctx.params
        wanted = [i for i, p in enumerate(params) if p.requires_grad]
        need_x = ctx.needs_input_grad[3]
        grad_x = torch.empty_like(x) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        with ctx.state.replay(), torch.enable_grad():
            for a, n in run_tiles(_tile_bounds(x.shape[dim], ctx.tiles)):
                tile = x.narrow(dim, a, n).detach().requires_grad_(need_x)
                y = ctx.fn(tile)
                inputs = ([tile] if need_x else []) + [params[i] for i in wanted]
                if not inputs:
                    continue
                grads = torch.autograd.grad(y, inputs, grad_out.narrow(dim, a, n), allow_unused=True)
                del y
                if need_x:
                    grad_x.narrow(dim, a, n).copy_(grads[0])
                    grads = grads[1:]
                for i, g in zip(wanted, grads, strict=True):
                    if g is None:
                        continue
                    if grad_params[i] is None:
                        grad_params[i] = g
                    else:
                        grad_params[i].add_(g)
                del grads
        return (None, None, None, grad_x, *grad_params)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
              token_dim: int, tiles: int | None = None) -> torch.Tensor:
    """``fn(x)`` computed over token tiles (NOTE [Tiled MLP]).

    ``fn``: a token-wise function (an MLP) using exactly ``params``; ``x``: ``[..., h]`` with the tokens
    along ``token_dim`` (memo's layers: ``[s, b, h]``, dim 0; Hugging Face's: ``[b, s, h]``, dim 1);
    ``tiles``: default ALST's ``ceil(s / h)``. Returns what ``fn(x)`` returns, ``[..., h_out]``.
    """
    if tiles is None:
        tiles = mlp_tiles(x.shape[token_dim], x.shape[-1])
    return _TiledMLPFunction.apply(fn, token_dim, tiles, x, *params)


class TiledMLP:
    """What replaces a layer's MLP (``site.owner.<site.attribute>``) while installed: the original MLP
    run by :func:`tiled_mlp`. ``tiles_run`` records the tile count of each call (tests, reports)."""

    def __init__(self, site: MLPSite, layer: nn.Module | None = None) -> None:
        self.site = site
        self.layer = layer
        self.fn = getattr(site.owner, site.attribute)
        self.tiles_run: list[int] = []

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        tiles = mlp_tiles(z.shape[self.site.token_dim], z.shape[-1])
        self.tiles_run.append(tiles)
        # The parameters the MLP holds at this call, not those it held when it was tiled: a wrapper may
        # register others for the call (FSDP2 its gathered ones in the layer's forward, NOTE [memo under
        # FSDP2] in memo/distributed/fsdp2.py), and gradients of the old ones would go nowhere.
        params = self.site.parameters if self.layer is None else find_mlp(self.layer).parameters
        return tiled_mlp(self.fn, z, params, self.site.token_dim, tiles)

    def install(self) -> None:
        owner = self.site.owner
        internal_assert(self.site.attribute not in vars(owner),
                        f"the MLP {self.site.attribute!r} of {type(owner).__name__} is already replaced")
        setattr(self.site.owner, self.site.attribute, self)

    def remove(self) -> None:
        if vars(self.site.owner).get(self.site.attribute) is self:
            delattr(self.site.owner, self.site.attribute)


def find_mlp(layer: nn.Module) -> MLPSite:
    """Where ``layer`` computes its MLP: what its layer adapter names (``LayerAdapter.mlp_site``: memo's
    layers, Hugging Face Llama/Qwen2/Mistral layers), else, for a layer class without an adapter, a
    ``layer.mlp`` submodule taking ``[b, s, h]`` (Hugging Face's convention). Raises :class:`MemoError`
    when there is none it can tile."""
    adapter = find_adapter(layer)
    site = adapter.mlp_site(layer) if adapter is not None else None
    if site is None and adapter is None and isinstance(getattr(layer, "mlp", None), nn.Module):
        site = MLPSite(layer.mlp, "forward", 1, tuple(layer.mlp.parameters()))
    if site is None:
        how = (f"its layer adapter ({type(adapter).__name__}) names no MLP" if adapter is not None
               else "it has no registered layer adapter and no `mlp` submodule")
        raise MemoError(
            f"memo.train: cannot tile the MLP of {type(layer).__name__}: {how}. The tiled MLP needs the MLP "
            "as its own callable (memo's layers: mlp(z); Hugging Face layers: layer.mlp); give the adapter "
            "an mlp_site(), or pick a strategy without a tiled MLP (torchtune-offload, full-recompute)")
    return site


# ---------------------------------------------------------------------------------------- checkpointed layers


class CheckpointedLayers:
    """Every layer's ``forward`` run under ``torch.utils.checkpoint(..., use_reentrant=False)`` (what
    ALST, torchtune's ``set_activation_checkpointing`` and HF's gradient checkpointing do), optionally
    inside ``offload``'s hooks (NOTE [Offload hooks]: the layer input goes to host) and with each layer's
    MLP tiled (NOTE [Tiled MLP]).

    The layers' ``forward`` (and MLP) are replaced by instance attributes, removed again by
    :meth:`remove`: no module is swapped, so the state dict keeps its names.
    """

    def __init__(self, layers: Sequence[nn.Module], offload: HostOffload | None = None,
                 tile_mlp: bool = False) -> None:
        self.layers = list(layers)
        self.offload = offload
        # Every MLP is found before anything is replaced: a model that cannot be tiled is refused whole.
        self.mlps = [TiledMLP(find_mlp(layer), layer) for layer in self.layers] if tile_mlp else []
        self._installed: list[nn.Module] = []

    def _checkpointed(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        offload = self.offload

        def run(*args: object, **kwargs: object) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            hooks = offload.hooks() if offload is not None else contextlib.nullcontext()
            with hooks:
                return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run

    def install(self) -> None:
        for layer in self.layers:
            internal_assert("forward" not in vars(layer),
                            f"{type(layer).__name__}.forward is already replaced")
        for mlp in self.mlps:
            mlp.install()
        for layer in self.layers:
            layer.forward = self._checkpointed(layer.forward)
            self._installed.append(layer)

    def remove(self) -> None:
        for layer in self._installed:
            if "forward" in vars(layer):
                del layer.forward
        self._installed = []
        for mlp in self.mlps:
            mlp.remove()
