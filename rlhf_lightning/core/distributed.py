"""Which of Lightning's strategies a stage runs under, the device mesh it shards the base over, and what a stage
computes over the ranks of a distributed fit (:class:`Ranks`).

DDP (``strategy: ddp``) replicates the module and needs nothing here. Lightning's ``ModelParallelStrategy``
(FSDP2) asks the module to shard itself in ``configure_model``: ours shard the shared base over the strategy's
``data_parallel`` mesh (see :mod:`rlhf_lightning.models.sharding`). Strategies our modules cannot run under are
refused with one line that says what to use instead.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor


def sharding_mesh(trainer: L.Trainer | None) -> Any | None:
    """The device mesh to shard the base over: the ``data_parallel`` mesh of a ``ModelParallelStrategy``, None
    for any strategy that leaves the module whole (single device, DDP). Raises ``ValueError`` for a strategy our
    modules do not support, or a ``ModelParallelStrategy`` set up for tensor parallelism or folder
    checkpoints."""
    if trainer is None:
        return None
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy | DeepSpeedStrategy):
        raise ValueError(
            f"trainer.strategy {name} is not supported: its wrapping cannot keep one frozen base under the "
            "adapters of every role; use lightning.pytorch.strategies.ModelParallelStrategy (FSDP2: the base "
            "sharded over ranks) or ddp (the base whole on each rank)")
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    mesh = strategy.device_mesh
    refuse_unsupported_settings(strategy, mesh["tensor_parallel"].size(), trainer.world_size)
    return mesh["data_parallel"]


def refuse_unsupported_settings(strategy: Any, tensor_parallel: int, world: int) -> None:
    """Raise ``ValueError`` for a ``ModelParallelStrategy`` set up for tensor parallelism (``tensor_parallel`` ranks
    of ``world``) or folder checkpoints."""
    if tensor_parallel > 1:
        raise ValueError(
            f"trainer.strategy ModelParallelStrategy with tensor_parallel_size={tensor_parallel}: "
            "our modules shard the base with FSDP2 over data-parallel ranks and apply no tensor parallelism; "
            f"set trainer.strategy.init_args.data_parallel_size={world} (devices x num_nodes) and "
            "tensor_parallel_size=1")
    # Lightning's attribute: the option is stored, not exposed.
    if getattr(strategy, "_save_distributed_checkpoint", False):
        raise ValueError(
            "trainer.strategy ModelParallelStrategy with save_distributed_checkpoint=true writes a folder per "
            "checkpoint, which the atomic checkpoints and the resume fallback do not cover; set "
            "trainer.strategy.init_args.save_distributed_checkpoint=false (the checkpoint holds only the "
            "adapters, heads and optimizer state, gathered on rank 0)")


def fill_sharding_defaults(trainer: L.Trainer, given: str) -> None:
    """A ``ModelParallelStrategy`` named alone runs as our modules support it: both sizes ``auto`` (Lightning's
    defaults, which mean tensor parallelism over a node's devices) become ``data_parallel_size`` = the world and
    ``tensor_parallel_size`` = 1, and ``save_distributed_checkpoint`` becomes false unless ``given`` (the command
    and its config files, as text) sets it. Values a user set are left to the refusals."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return
    if strategy._data_parallel_size == "auto" and strategy._tensor_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_processes * strategy.num_nodes
        strategy._tensor_parallel_size = 1
    if "save_distributed_checkpoint" not in given:
        strategy._save_distributed_checkpoint = False


def check_parallel_sizes(trainer: L.Trainer) -> None:
    """Refuse a ``ModelParallelStrategy`` whose ``data_parallel_size`` x ``tensor_parallel_size`` is not the number
    of processes, or that is set up for tensor parallelism or folder checkpoints, before any process starts
    (Lightning finds the sizes once every rank has started, and each prints its traceback; the rest
    :func:`sharding_mesh` would refuse on every rank once the model is built). ``auto`` counts as Lightning resolves
    it: ``num_nodes`` and ``devices``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return
    devices, nodes = strategy.num_processes, strategy.num_nodes
    world = devices * nodes
    # Lightning's attributes: the sizes are stored as given ("auto" or a number), not exposed.
    sizes = {"data_parallel_size": (strategy._data_parallel_size, nodes),
             "tensor_parallel_size": (strategy._tensor_parallel_size, devices)}
    resolved = {name: auto if given == "auto" else int(given) for name, (given, auto) in sizes.items()}
    if resolved["data_parallel_size"] * resolved["tensor_parallel_size"] == world:
        refuse_unsupported_settings(strategy, resolved["tensor_parallel_size"], world)
        return
    shown = {name: f"auto ({resolved[name]})" if given == "auto" else str(given) for name, (given, _) in sizes.items()}
    raise ValueError(
        f"trainer.strategy.init_args.data_parallel_size={shown['data_parallel_size']} x tensor_parallel_size="
        f"{shown['tensor_parallel_size']} does not match the world size {world} (trainer.devices={devices} x "
        f"trainer.num_nodes={nodes}); set data_parallel_size={world} and tensor_parallel_size=1: our modules "
        "shard the base over data-parallel ranks")


class Ranks:
    """What a module computes over the ranks of a distributed fit (a stage module's :attr:`~rlhf_lightning.core.
    stage.StageModule.ranks`): each reduction is the value itself outside one (no Trainer, or one process), and
    inside one every rank must call it.

    Args:
        trainer: the module's Trainer; None outside a fit.
    """

    def __init__(self, trainer: L.Trainer | None) -> None:
        self.trainer = trainer

    @property
    def distributed(self) -> bool:
        """Whether this is a fit of several processes (False outside a Trainer)."""
        return self.trainer is not None and self.trainer.world_size > 1

    def reduce(self, value: Tensor, reduce_op: str) -> Tensor:
        """``value`` reduced over the ranks with ``reduce_op`` (``sum``, ``mean``, ``max``, ...)."""
        if not self.distributed:
            return value
        return self.trainer.strategy.reduce(value.clone(), reduce_op=reduce_op)  # Lightning reduces in place

    def mean(self, value: Tensor) -> Tensor:
        """The mean of ``value`` over the ranks."""
        return self.reduce(value, "mean")

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the ranks: what batch statistics take (``over_ranks``) to be those of the global
        batch."""
        return self.reduce(value, "sum")

    def most(self, count: int) -> int:
        """The largest ``count`` of any rank (``count`` outside a distributed fit): as many micro-batches on every
        rank."""
        if not self.distributed:
            return count
        return int(self.reduce(torch.tensor(count, device=self.trainer.strategy.root_device), "max"))
