"""Fused activations: transformers' Python tanh-GELU replaced by one kernel, with the same numbers.

Off with ``base.fused_activations: false`` (the plain path is then transformers' own module).
"""

from __future__ import annotations

from torch import nn
from transformers.activations import GELUTanh, NewGELUActivation


def fuse_tanh_gelu(model: nn.Module) -> int:
    """Replace transformers' Python tanh-GELU modules (``gelu_new``) in ``model`` by the fused ``GELUTanh``.

    The Python formula runs six element-wise kernels over the MLP's widest activation and keeps their outputs
    for the backward; the fused kernel computes the same function in one pass and keeps only its input. The
    saved config is unchanged, so an exported model reloads with its original activation. Returns the number
    of modules replaced.
    """
    replaced = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                replaced += 1
    return replaced
