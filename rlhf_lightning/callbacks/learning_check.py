"""A run that learns nothing says so: no gradient reaching the trainable weights for several batches in a row, or
no signal from the reward (every group tied) whatever gradient a KL term still brings."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.run_shape import batches_done, run_name
from rlhf_lightning.models.sharding import full_tensor

Action = Literal["warn", "raise"]


class NotLearningError(RuntimeError):
    """No gradient reached the trainable weights for ``patience`` training batches (``LearningCheck(action=raise)``)."""


@dataclass(frozen=True)
class Cause:
    """A reason for zero gradients that a logged metric shows: ``metric`` (after the module's prefix) at a value
    for which ``applies`` holds, in a module whose hyper-parameter ``setting`` (when named) is on."""

    metric: str
    applies: Callable[[float], bool]
    text: str
    setting: str | None = None
    no_signal: bool = False  # the reward says nothing here: a gradient (a KL term's) does not make it learning


# In the order they are looked for; the first that applies names the stall.
CAUSES = (
    Cause("objective/frac_zero_std", lambda value: value >= 1.0,
          "every group's responses scored alike, so every advantage was 0 (raise samples_per_prompt or the reward's "
          "resolution, or start from a policy that solves some prompts)", no_signal=True),
    Cause("objective/tie_frac", lambda value: value >= 1.0,
          "the two responses of every pair scored alike, so no pair was ordered (check the reward source)",
          no_signal=True),
    Cause("response/eos_frac", lambda value: value <= 0.0,
          "no response stopped: with loss.mask_truncated_completions every response is masked (raise "
          "sampling.max_new_tokens)", setting="loss.mask_truncated_completions"),
)


def setting_of(hparams: Mapping[str, Any], key: str) -> Any:
    """A hyper-parameter by its config key, a group's field by ``group.field`` (None where absent)."""
    value: Any = hparams
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


@dataclass
class Stall:
    """Training batches ``first``..``last`` (1-based) without a gradient, and why."""

    first: int
    last: int
    cause: str
    what: str = "no gradient reached the trainable weights"


class LearningCheck(Callback):
    """Watches every optimizer step's gradient on the trainable weights, and the reward's signal. When ``patience``
    training batches in a row (iterations of the on-policy loop, batches of the offline stages) brought no
    optimizer step with a non-zero, finite gradient — every advantage 0, every pair tied, every row masked, every
    step skipped — or brought one with no signal from the reward (every group's or pair's scores tied: a KL term's
    gradient alone, which Adam turns into full-size steps that move the policy without learning anything), it
    warns with the cause and the metric that shows it::

        [grpo] not learning: no gradient reached the trainable weights in iterations 1-3: every group's responses
        scored alike, so every advantage was 0 (...) (grpo/objective/frac_zero_std 1)

    and the end-of-fit summary repeats it. With ``action: raise`` the fit stops there instead (for sweeps: a
    trial that cannot learn ends in seconds, with its reason). Under gradient accumulation only the batches that
    end with an optimizer step count.

    The command line adds it to every fit: ``--not_learning.patience 5``, ``--not_learning.action raise``.

    Args:
        patience: training batches in a row without a gradient before it speaks; 0 turns the check off.
        action: ``warn`` (a warning line, repeated in the summary) or ``raise`` (stop the fit with that line).
    """

    def __init__(self, patience: int = 3, action: Action = "warn") -> None:
        if patience < 0 or action not in ("warn", "raise"):
            raise ValueError(f"LearningCheck: patience must be >= 0 and action 'warn' or 'raise', got {patience}, "
                             f"{action!r}")
        self.patience = patience
        self.action = action
        self.stalls: list[Stall] = []
        self._streak = 0  # training batches in a row without a gradient (those that count)
        self._last_learning = 0  # the last training batch that brought a gradient (0: none yet)
        self._steps = self._learning_steps = 0  # in the current training batch

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before a checkpoint's state is loaded: a fit starts clean, a resumed one then takes its checkpoint's.
        self.stalls, self._streak, self._last_learning = [], 0, 0

    def state_dict(self) -> dict[str, Any]:
        """Kept in checkpoints: a resumed fit goes on counting, and its summary still names earlier stalls."""
        return {"stalls": [vars(stall).copy() for stall in self.stalls], "streak": self._streak,
                "last_learning": self._last_learning}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stalls = [Stall(**stall) for stall in state_dict.get("stalls", [])]
        self._streak, self._last_learning = state_dict.get("streak", 0), state_dict.get("last_learning", 0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._steps = self._learning_steps = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if not self.patience or self._learning_steps:  # one step with a gradient settles the batch
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Sharded gradients are combined over the ranks (every rank calls this hook).
        norm = float(full_tensor(torch.nn.utils.get_total_norm(grads))) if grads else 0.0
        self._steps += 1
        self._learning_steps += math.isfinite(norm) and norm > 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.patience:
            return
        done = batches_done(trainer)
        silent = self.without_signal(trainer, pl_module)
        if self._learning_steps and silent is None:
            self._streak, self._last_learning = 0, done
            return
        # A batch of an accumulation window that takes no step says nothing; an iteration of the on-policy loop
        # whose steps were all skipped does.
        if not self._steps and pl_module.automatic_optimization:
            return
        self._streak += 1
        if self._streak > self.patience:
            self.stalls[-1].last = done
        elif self._streak == self.patience:
            if self._learning_steps:  # a gradient reached the weights, but nothing of the reward's
                stall = Stall(self._last_learning + 1, done, f"{silent}; the gradient that still reached the weights "
                              "came from other terms (a KL penalty), which move the policy without learning from the "
                              "reward", "the reward gave no signal")
            else:
                stall = Stall(self._last_learning + 1, done, self.cause(trainer, pl_module))
            self.stalls.append(stall)
            line = self.message(pl_module, stall)
            if self.action == "raise":
                raise NotLearningError(f"{line} (LearningCheck action: raise)")
            rank_zero_warn(line)

    @staticmethod
    def without_signal(trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
        """The cause, with its metric, when this batch's reward gave no signal (every group or pair tied); else
        None."""
        prefix = getattr(pl_module, "metric_prefix", "")
        for cause in CAUSES:
            value = trainer.callback_metrics.get(f"{prefix}/{cause.metric}")
            if cause.no_signal and value is not None and cause.applies(float(value)):
                return f"{cause.text} ({prefix}/{cause.metric} {float(value):.4g})"
        return None

    @staticmethod
    def cause(trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """Why no gradient came, from the metrics the batch logged."""
        prefix = getattr(pl_module, "metric_prefix", "")
        metrics: Mapping[str, Any] = trainer.callback_metrics
        for cause in CAUSES:
            value = metrics.get(f"{prefix}/{cause.metric}")
            if (value is not None and cause.applies(float(value))
                    and (cause.setting is None or setting_of(pl_module.hparams, cause.setting))):
                return f"{cause.text} ({prefix}/{cause.metric} {float(value):.4g})"
        skipped = metrics.get(f"{prefix}/skipped_steps")
        if skipped is not None and float(skipped) > 0:
            return f"optimizer steps were skipped for non-finite values ({prefix}/skipped_steps {float(skipped):.4g})"
        return "every optimizer step's gradient was 0 (a loss that does not depend on the trainable weights?)"

    @staticmethod
    def message(pl_module: L.LightningModule, stall: Stall) -> str:
        unit = "batches" if pl_module.automatic_optimization else "iterations"
        span = f"{stall.first}-{stall.last}" if stall.last > stall.first else str(stall.first)
        return f"[{run_name(pl_module)}] not learning: {stall.what} in {unit} {span}: {stall.cause}"
