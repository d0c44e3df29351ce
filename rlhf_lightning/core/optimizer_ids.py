"""Optimizer state that resumes in any layout: one process, DDP, FSDP2.

An optimizer's state dict keys each parameter's moments by an integer. torch numbers the parameters in the order
the optimizer holds them (0, 1, ... over its groups); Lightning's ``ModelParallelStrategy`` (FSDP2) numbers them by
their position in the module's ``parameters()``, frozen ones included, both when it writes a checkpoint and when it
reads an integer-keyed one. A one-process checkpoint resumed under FSDP2 therefore gave each parameter another
one's moments ("The size of tensor a (32) must match the size of tensor b (128)"). So one process and DDP write
FSDP2's numbering too: torch's own ``load_state_dict`` maps the ids by their order within each group, whatever
their values, so one process reads either numbering, and FSDP2 reads the one-process file.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer


def numbered_by_module_position(state: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """``state`` (``optimizer.state_dict()``, torch's numbering) with each parameter's id replaced by its position
    in ``module.parameters()``; unchanged when the optimizer holds a parameter that is not the module's."""
    position = {id(parameter): index for index, parameter in enumerate(module.parameters())}
    held = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    if any(id(parameter) not in position for parameter in held):
        return state
    new_id = {old: position[id(parameter)] for old, parameter in enumerate(held)}
    return {
        **state,
        "state": {new_id[old]: moments for old, moments in state["state"].items()},
        "param_groups": [{**group, "params": [new_id[old] for old in group["params"]]}
                         for group in state["param_groups"]],
    }
