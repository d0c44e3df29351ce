"""The command line and what surrounds it: the LightningCLI and its subcommands (``command_line``), one-line errors
(``errors``) naming the file and line of a refused config key (``config_keys``), quiet third-party logs (``quiet``), the Trainer's
batch limits read as ints whatever was imported first (``trainer_limits``), a failure on one rank reported on all (``rank_failures``), the W&B
logger (``loggers``), model cards of exports (``model_card``), ``python -m rlhf_lightning merge``
(``merge_command``) and ``evaluate`` (``evaluate_command``: lm-evaluation-harness tasks); what the command line
answers before the training stack is imported (``early``), among them a subcommand's ``--help`` and
``--print_config`` kept from an earlier run with nothing changed (``answers``); the entry point of ``python -m
rlhf_lightning`` and the ``rlhf-lightning`` script, which tries those first (``entry``).

``RLHFCLI`` and ``main`` are imported when first used: the modules beside them (errors, config keys) need no
training stack."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RLHFCLI", "main"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'rlhf_lightning.cli' has no attribute {name!r}")
    value = getattr(importlib.import_module("rlhf_lightning.cli.command_line"), name)
    globals()[name] = value
    return value
