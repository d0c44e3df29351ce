"""What a fit says at its start and its end: a warning when it would never validate, and a summary that leads
with the held-out metrics, gives gold its scale and pass@k its standard error, and repeats the KL spikes."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.learning_check import LearningCheck
from rlhf_lightning.callbacks.lm_evaluation import LMEvaluation
from rlhf_lightning.callbacks.progress_lines import (
    HIDDEN,
    duration,
    held_out,
    metric_text,
    unit,
)
from rlhf_lightning.callbacks.run_shape import batches_done, run_name, validation_problem
from rlhf_lightning.callbacks.spikes import Spike, SpikeCheck

PASS_AT_K = re.compile(r"/val/(pass|maj)@\d+$")


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute."""
    absolute = Path(path).absolute()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def plural(noun: str, count: int) -> str:
    """``noun`` for one, its plural otherwise."""
    return noun if count == 1 else noun + ("es" if noun.endswith("ch") else "s")


def gold_scale(at_start: Mapping[str, float], last: Mapping[str, float], responses: int | None) -> str:
    """``gold scale: ...``: the gold's change measured in standard deviations of the starting policy's held-out
    gold (``<prefix>/val/gold_std``) when validation logs it, else what is known: the change in the gold
    reward's own units. Empty without a held-out gold."""
    gold = next((name for name in last if name.endswith("/val/gold")), None)
    if gold is None:
        return ""
    counted = f"{responses} held-out {plural('response', responses)}" if responses else "the held-out responses"
    if gold not in at_start:
        return (f"gold scale: unknown (the starting policy was not validated, so neither its gold over {counted} "
                "nor the change is known)")
    change = last[gold] - at_start[gold]
    spread = at_start.get(f"{gold}_std")
    if spread is not None and spread > 0:
        return (f"gold scale: SD {spread:.4g} over the starting policy's {counted} ({gold}_std); the change "
                f"{change:+.4g} is {change / spread:+.3g} SD")
    return (f"gold scale: the spread of the gold over {counted} is not logged; the change {change:+.4g} is in the "
            "gold reward's own units")


def pass_at_k_text(last: Mapping[str, float], problems: int | None) -> str:
    """``pass@k (± binomial standard error over 64 held-out problems): pass@1 0.41 ± 0.061 · ...``: each pass@k
    and maj@k with ``sqrt(p (1 - p) / n)`` over the ``n`` held-out problems. Empty without pass@k or without the
    count."""
    values = {name: value for name, value in last.items() if PASS_AT_K.search(name)}
    if not values or not problems:
        return ""
    errors = " · ".join(f"{name.rsplit('/', 1)[1]} {p:.4g} ± {math.sqrt(max(p * (1 - p), 0.0) / problems):.2g}"
                        for name, p in values.items())
    return f"pass@k (± binomial standard error over {problems} held-out {plural('problem', problems)}): {errors}"


def spikes_text(name: str, unit_name: str, spikes: Sequence[Spike]) -> str:
    """``[ppo] KL spikes: iteration 15: ppo/objective/kl 24 against 1.9 ± 0.75 · ...; iteration 40: ...``."""
    at: dict[int, list[Spike]] = {}
    for spike in spikes:
        at.setdefault(spike.at, []).append(spike)
    return f"[{name}] KL spikes: " + "; ".join(f"{unit_name} {batch}: " + " · ".join(s.text() for s in found)
                                               for batch, found in at.items())


class RunReport(Callback):
    """At the start of a fit, warn once when its validation interval exceeds its length (it would never
    validate); at the end, print a summary on rank 0 that leads with the last validation's held-out metrics
    (gold where the task knows it, KL, score; validation loss and accuracy for SFT, reward model and DPO), then the
    last training values, then where the checkpoints and exported adapters are::

        [ppo] fit ended: 96 iterations, 384 optimizer steps, 27m12s
          held-out (validation after iteration 96): ppo/val/gold 1.967 · ppo/val/kl 7.84 · ppo/val/score 2.1 · ...
          change (iteration 0 → 96): ppo/val/gold -0.08 → 1.967 · ppo/val/kl 0 → 7.84 · ...
          gold scale: SD 0.81 over the starting policy's 64 held-out responses (ppo/val/gold_std); the change ...
          pass@k (± binomial standard error over 64 held-out problems): pass@1 0.41 ± 0.061 · ...   (with pass@k)
          [ppo] not learning: ...   (only when LearningCheck saw a stall)
          [ppo] KL spikes: iteration 15: ppo/objective/kl 24 against 1.9 ± 0.75 · ...   (when SpikeCheck saw one)
          training (last iteration): gold 2.14 · kl 8.01 · reward 3.2
          run folder: outputs/ppo · checkpoints: outputs/ppo/checkpoints · exports: outputs/ppo/export

    The change line compares with the validation before the first update (see
    :class:`~rlhf_lightning.callbacks.ValidateAtStart`); its values are kept in checkpoints, so a resumed fit
    prints it too. The gold's change is measured in standard deviations of the starting policy's held-out gold
    when validation logs ``<prefix>/val/gold_std``, in the gold's own units otherwise; pass@k and maj@k get the
    binomial standard error ``sqrt(p (1 - p) / n)`` over the ``n`` held-out problems. A subclass that keeps its
    parent's metric prefix is named by its class (``[MyGRPO] fit ended``). Paths are relative to the working
    directory when they lie under it.

    The CLI adds it to every fit and prints the summary once the loggers have finished (W&B prints its own
    summary then), so that it is the last thing a run says.

    Args:
        print_at_fit_end: print the summary when the fit ends; false = only keep it in ``summary_text`` for the
            caller to print.
    """

    def __init__(self, print_at_fit_end: bool = True) -> None:
        self.print_at_fit_end = print_at_fit_end
        self.summary_text: str | None = None
        self._started = 0.0
        self._held_out: dict[str, float] = {}
        self._validated_after: int | None = None
        self.at_start: dict[str, float] = {}  # the held-out metrics of the starting policy (kept in checkpoints)
        self.fit_seconds: float | None = None  # the fit's wall time, once it ended (the model card reads it)
        self.held_out_prompts: int | None = None  # the prompts (problems) the last validation sampled, all ranks
        self._prompts = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()
        self._held_out, self._validated_after, self.fit_seconds = {}, None, None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.at_start = {}  # before a checkpoint's state is loaded: a resumed fit then takes its checkpoint's

    def state_dict(self) -> dict[str, Any]:
        return {"at_start": dict(self.at_start)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.at_start = dict(state_dict.get("at_start") or {})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        problem = validation_problem(trainer)
        if problem:
            rank_zero_warn(problem)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prompts = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        # The on-policy modules' held-out batches are prompt batches: one problem per prompt for pass@k.
        if isinstance(batch, Mapping) and isinstance(batch.get("prompt"), list | tuple):
            self._prompts += len(batch["prompt"])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        # Every rank counted its share (a collective: every rank is here).
        self.held_out_prompts = int(trainer.strategy.reduce(
            torch.tensor(float(self._prompts), device=pl_module.device), reduce_op="sum"))
        self._held_out = held_out(trainer.callback_metrics)
        self._validated_after = batches_done(trainer)
        if self._validated_after == 0:
            self.at_start = dict(self._held_out)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_seconds = time.monotonic() - self._started
        if not trainer.is_global_zero:
            return
        self.summary_text = self.summary(trainer, pl_module)
        if self.print_at_fit_end:
            print(self.summary_text, flush=True)

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """The end-of-fit summary (see the class)."""
        name = unit(pl_module)
        done = batches_done(trainer)
        seconds = self.fit_seconds if self.fit_seconds is not None else time.monotonic() - self._started
        lines = [f"[{run_name(pl_module)}] fit ended: {done} {plural(name, done)}, "
                 f"{trainer.global_step} optimizer steps, {duration(seconds)}"]
        if self._held_out:
            lines.append(f"  held-out (validation after {name} {self._validated_after}): "
                         f"{metric_text(self._held_out)}")
            change = self.change_text()
            if change:
                lines.append(f"  change ({name} 0 → {self._validated_after}): {change}")
            scale = gold_scale(self.at_start, self._held_out, self.held_out_prompts)
            errors = pass_at_k_text(self._held_out, self.held_out_prompts)
            lines += [f"  {text}" for text in (scale, errors) if text]
        else:
            reason = validation_problem(trainer) or ("trainer.limit_val_batches=0 or no validation data"
                                                     if not trainer.enable_validation
                                                     or trainer.limit_val_batches == 0 else "")
            lines.append("  held-out: no validation ran" + (f" ({reason})" if reason else ""))
        for check in trainer.callbacks:
            if isinstance(check, LearningCheck):
                lines += [f"  {check.message(pl_module, stall)}" for stall in check.stalls]
            if isinstance(check, SpikeCheck) and check.spikes:
                lines.append(f"  {spikes_text(run_name(pl_module), name, check.spikes)}")
            if isinstance(check, LMEvaluation) and check.last_values:
                lines.append(f"  lm-eval (after {name} {check.last_iteration}): {metric_text(check.last_values)}")
        training = {key: value for key, value in trainer.progress_bar_metrics.items()
                    if key not in HIDDEN and "/val/" not in key}
        if training:
            lines.append(f"  training (last {name}): {metric_text(training)}")
        lines.append("  " + " · ".join(self.places(trainer, pl_module)))
        return "\n".join(lines)

    def change_text(self) -> str:
        """``ppo/val/gold -0.08 → 1.967 · ...``: each held-out metric from the starting policy's validation to the
        last one (empty without a validation at the start, or when the last one was it)."""
        if not self.at_start or not self._validated_after:
            return ""
        return " · ".join(f"{name} {self.at_start[name]:.4g} → {value:.4g}"
                          for name, value in self._held_out.items() if name in self.at_start)

    @staticmethod
    def places(trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Where the run wrote: its folder, checkpoints and exports (adapters, or SFT's model)."""
        places = [f"run folder: {shown_path(trainer.default_root_dir)}"]
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            places.append(f"checkpoints: {shown_path(checkpoint.dirpath)}")
        export: Any = getattr(pl_module, "export_folder", None)
        if export is not None:
            places.append(f"exports: {shown_path(export)}")
        return places
