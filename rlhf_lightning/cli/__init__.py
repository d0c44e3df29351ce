"""The command line and what surrounds it: the LightningCLI and its subcommands (``command_line``), one-line errors
(``errors``) naming the file and line of a refused config key (``config_keys``), quiet third-party logs (``quiet``), a failure on one rank reported on all (``rank_failures``), the W&B
logger (``loggers``), model cards of exports (``model_card``) and ``python -m rlhf_lightning merge``
(``merge_command``)."""

from rlhf_lightning.cli.command_line import RLHFCLI, main

__all__ = ["RLHFCLI", "main"]
