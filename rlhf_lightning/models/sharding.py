"""The shared base sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), as Lightning's
``ModelParallelStrategy`` runs it: one base per job, 1/world of it per rank.

Layout (:func:`shard`):

- each decoder layer is one FSDP unit holding its frozen base weights *and* the LoRA weights of every role
  (policy, critic, reward) that peft injected into it. FSDP2 shards per parameter, so a unit may mix frozen and
  trainable parameters: it all-gathers all of them and reduce-scatters the gradients that exist, which are the
  adapters' (its one rule, a single dtype among a unit's *trainable* parameters, holds: the adapters share theirs
  whatever the base's). One unit per layer keeps the all-gathers few and large; units per LoRA matrix would
  multiply them by the number of adapted linears.
- the :class:`~rlhf_lightning.models.shared_base.SharedBase` itself is the root unit: the embeddings, the final
  norm, the LM head (tied to the embeddings in models such as GPT-2, so they must share a unit) and the scalar
  heads. Its methods that run the model (:data:`FORWARD_METHODS`) are registered with FSDP, so they gather the
  root's parameters as ``forward`` would. FSDP2 keeps a root unit gathered after its forward (it is needed again
  by the backward), which is what lets the fused log-prob head and the value head read the LM head's and their
  own weights straight after :meth:`~rlhf_lightning.models.shared_base.SharedBase.hidden_states`.

The reference role is the same units with the adapters switched off: there is still one copy of the base, now
split over the ranks.

Loading (:func:`load_sharded`): rank 0 reads the weights and builds every role as a single process does; the
other ranks build the same modules on the ``meta`` device (no memory, no file read); after sharding, each rank
receives its shard of every parameter and every buffer from rank 0. So no rank but the first ever holds the whole
base, and every rank starts from the same adapters and heads as a one-process run with the same seed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

FORWARD_METHODS = ("hidden_states", "next_token_logits", "score", "full_logits")


def fsdp_available() -> bool:
    """Whether this torch has FSDP2 (``torch.distributed.fsdp.fully_shard``, 2.6 or newer)."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` was applied to it)."""
    if not fsdp_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a ``DTensor``, any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of ``tensor``: a ``DTensor`` all-gathered (a collective: every rank must call it), any other
    tensor itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM: the modules of the classes it declares unsplittable
    (``_no_split_modules``: ``GPT2Block``, ``LlamaDecoderLayer``...), also once sharded (FSDP2 gives each a
    subclass of its own, ``FSDPGPT2Block``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules()
              if any(cls.__name__ in names for cls in type(module).__mro__)]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules is "
                         f"{sorted(names) or 'empty'}): cannot shard it layer by layer")
    return layers


def shard(base: nn.Module, mesh: Any, layers: Iterable[nn.Module]) -> None:
    """Apply FSDP2 to ``base`` (a ``SharedBase``): one unit per decoder layer in ``layers``, the base as the root
    (see the module's docstring), and its model-running methods registered as forward methods."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # FSDP2 warns that the root returns a view (the decoder's hidden states are one), since an in-place op on it
    # would skip the root's pre-backward hook. Nothing here modifies a root output in place (the equivalence tests
    # compare every gradient with one process's), and a copy of the hidden states would cost memory for nothing.
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \((FSDP)?{type(base).__name__}\) returned a view "
                            "tensor", category=UserWarning)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(base, mesh=mesh)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(base, name)


def build_sharded(build: Callable[[bool], nn.Module], mesh: Any, layers_of: Callable[[nn.Module], list[nn.Module]],
                  device: torch.device, convert: Callable[[nn.Module], nn.Module] = lambda model: model) -> nn.Module:
    """Build a model with ``build(empty)``, shard it over ``mesh`` and give every rank its shard of rank 0's
    values.

    ``build(False)`` (rank 0) reads the weights; ``build(True)`` (the other ranks) must build the same modules,
    with the same names and shapes, on the ``meta`` device. ``layers_of(model)`` are the units to shard per layer.
    ``convert(model)`` runs before sharding (a precision plugin's ``convert_module``: a sharded model's dtype
    cannot change afterwards).
    """
    rank = dist.get_rank()
    if rank == 0:
        model = convert(build(False))
    else:
        with torch.device("meta"):
            model = convert(build(True))
    # Rank 0's whole values, kept until they are sent: after sharding, rank 0's parameters hold only its shard.
    full_state = dict(model.state_dict()) if rank == 0 else {}
    buffers = [(owner, name) for owner in model.modules() for name in owner._buffers
               if owner._buffers[name] is not None]
    shapes = [(tuple(owner._buffers[name].shape), owner._buffers[name].dtype) for owner, name in buffers]
    shard(model, mesh, layers_of(model))
    if rank != 0:
        model.to_empty(device=device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers are not sharded, and some (rotary frequencies) are computed at construction rather than saved:
    # every rank takes rank 0's.
    for (owner, name), (shape, dtype) in zip(buffers, shapes, strict=True):
        value = owner._buffers[name]
        if rank != 0:
            value = torch.empty(shape, dtype=dtype, device=device)
        value = value.to(device)
        dist.broadcast(value, src=0)
        owner._buffers[name] = value
    del full_state
    return model


def reshard_all(module: nn.Module) -> None:
    """Free every gathered FSDP2 unit of ``module`` (the root stays gathered after a forward pass, by FSDP2's
    design): afterwards each rank holds only its shards."""
    for unit in module.modules():
        if is_sharded(unit):
            unit.reshard()


def local_numel(parameters: Iterable[Tensor]) -> int:
    """Elements of ``parameters`` held by this rank (a ``DTensor``'s local shard, any other tensor whole)."""
    return sum(local_tensor(parameter).numel() for parameter in parameters)


@contextlib.contextmanager
def gathered(base: nn.Module, whole: bool = True) -> Iterator[None]:
    """Run the block with the sharded ``base`` gathered: its root unit always (code that calls the transformers
    model itself, such as ``generate``, bypasses the root's registered methods), and with ``whole`` every
    decoder layer too, kept gathered until the block ends (one all-gather per layer for the whole block, instead
    of one per layer per forward pass: a decode of ``R`` tokens makes ``R`` passes). Nothing happens to a base
    that is not sharded.

    A rollout enters it once, around every pass it makes. A block inside it (a subclass's pass that samples again)
    finds the base gathered already and leaves it to the outer block, which alone frees the layers.
    """
    if getattr(base, "_gathered", False) or not is_sharded(base):
        yield
        return
    base.unshard()
    layers = [module for module in base.modules() if module is not base and is_sharded(module)] if whole else []
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
        layer.unshard()
    base._gathered = True
    try:
        yield
    finally:
        base._gathered = False
        for layer in layers:
            layer.reshard()
            layer.set_reshard_after_forward(True, recurse=False)
