"""What bounds a fit, read from the Trainer: its length in training batches and when it validates; and the name
a run's lines start with (:func:`run_name`)."""

from __future__ import annotations

import math

import lightning as L


def batches_done(trainer: L.Trainer) -> int:
    """Training batches processed in the whole fit (resumed ones included), the current one too."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed


def step_bounded(trainer: L.Trainer) -> bool:
    """Whether the run ends at ``max_steps`` (``max_epochs`` left at -1, as the SFT, reward and DPO configs do)."""
    return trainer.max_epochs in (-1, None) and trainer.max_steps is not None and trainer.max_steps > 0


def training_batches(trainer: L.Trainer) -> int | None:
    """Training batches (iterations of the on-policy loop) the whole fit will run, resumed ones included; None
    when unknown (an iterable dataset of unknown length, or a run bounded by optimizer steps)."""
    per_epoch = trainer.num_training_batches
    if step_bounded(trainer) or not isinstance(per_epoch, int) or per_epoch <= 0 or math.isinf(per_epoch):
        return None
    if trainer.max_epochs is None or trainer.max_epochs < 0:
        return None
    return per_epoch * trainer.max_epochs


def validation_problem(trainer: L.Trainer) -> str | None:
    """Why a fit that has validation data will never validate, or None: an interval longer than the run."""
    if not trainer.enable_validation or trainer.limit_val_batches == 0:
        return None
    interval = trainer.val_check_interval
    if trainer.check_val_every_n_epoch is None and isinstance(interval, int):
        if step_bounded(trainer):  # automatic optimization: a step every accumulate_grad_batches batches
            manual = not trainer.lightning_module.automatic_optimization  # steps per batch: the module's own
            length = None if manual else trainer.max_steps * trainer.accumulate_grad_batches
            unit = "training batches (max_steps x accumulate_grad_batches)"
        else:
            length, unit = training_batches(trainer), "training batches"
        if length is not None and interval > length:
            return (f"trainer.val_check_interval={interval} is longer than the run's {length} {unit}: no validation "
                    f"will run; lower it (e.g. to {max(length // 4, 1)}) or set trainer.limit_val_batches=0 to "
                    "run without validation")
    every = trainer.check_val_every_n_epoch
    if every is not None and not step_bounded(trainer) and trainer.max_epochs and 0 < trainer.max_epochs < every:
        return (f"trainer.check_val_every_n_epoch={every} is more than the run's max_epochs={trainer.max_epochs}: "
                "no validation will run; lower it or set trainer.limit_val_batches=0 to run without validation")
    return None


def run_name(pl_module: L.LightningModule) -> str:
    """The name a summary starts with: the module's metric prefix (``ppo``), but the class name for a subclass
    that inherits its parent's prefix (a researcher's ``MyGRPO`` logging under ``grpo/``), so that its summary is
    not taken for the parent's; the class name for a module without a prefix."""
    cls = type(pl_module)
    prefix = getattr(pl_module, "metric_prefix", None)
    own = any("metric_prefix" in vars(klass) for klass in cls.__mro__
              if klass is cls or klass.__module__.split(".")[0] != "rlhf_lightning")
    return prefix if prefix and (own or cls.__module__.startswith("rlhf_lightning.")) else cls.__name__
