"""``python -m rlhf_lightning fit|validate|test --config configs/<stage>.yaml`` (LightningCLI, subclass mode)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import lightning as L
import yaml
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from rlhf_lightning.loggers import WandbLogger


class LogConfigCallback(SaveConfigCallback):
    """Saves the fully resolved config next to the run and stores it in the W&B run's config."""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and not isinstance(logger.experiment.config, dict):
                logger.experiment.config.update({"cli": config}, allow_val_change=True)


class RLHFCLI(LightningCLI):
    """LightningCLI for every stage: ``model`` and ``data`` are chosen by ``class_path`` in the config."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=LogConfigCallback,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"logger": {"class_path": "rlhf_lightning.loggers.WandbLogger"}},
            args=args,
            run=run,
        )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m rlhf_lightning`` and the ``rlhf-lightning`` script.

    ``fit``, ``validate``, ``test`` and ``predict`` go to LightningCLI; ``merge`` folds an adapter into its base.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["merge"]:
        from rlhf_lightning.merge import main as merge_main

        merge_main(argv[1:])
        return
    RLHFCLI(args=None if args is None else argv)


if __name__ == "__main__":
    main()
