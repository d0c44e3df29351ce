"""What every stage's LightningModule shares: building the base in ``configure_model`` (sharded under FSDP2),
optimizers, checkpoints without frozen weights, and the guard that keeps NaN and infinity out of optimizer steps
and checkpoints."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from rlhf_lightning.core.distributed import Ranks, sharding_mesh
from rlhf_lightning.core.optimizer_ids import numbered_by_module_position
from rlhf_lightning.models.loading import check_positions, load_causal_lm, load_tokenizer
from rlhf_lightning.models.sharding import build_sharded, local_tensor
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.runs.resume import CLASS_KEY, class_mismatch, class_path, saved_state_keys
from rlhf_lightning.runs.run_folder import export_path, refuse_overwrite, refuse_unwritable
from rlhf_lightning.utils import checks, compatibility
from rlhf_lightning.utils.atomic_io import CheckpointError
from rlhf_lightning.utils.nonfinite import (
    SKIP_HINT,
    NonFiniteError,
    all_finite,
    check_finite_weights,
    first_nonfinite_loss,
    listing,
    nonfinite_names,
)
from rlhf_lightning.utils.optim import OptimizerSettings, adamw, lr_lambda
from rlhf_lightning.utils.timing import phase

log = logging.getLogger(__name__)


def constructor_arguments(cls: type) -> list[str]:
    """Every argument ``cls``'s constructor takes, as the command line reads it: its parents' where it passes
    ``**kwargs`` up, and its parts' where it passes them on (the online modules' ``Policy``), less those it fixes
    itself in that call (online DPO's ``samples_per_prompt``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, "init", fail_untyped=False)
    except Exception:  # noqa: BLE001 - a class the parser cannot read: no names to tell
        return []
    names = [action.dest.removeprefix("init.") for action in parser._actions if action.dest.startswith("init.")]
    return list(dict.fromkeys(name.split(".")[0] for name in names))


class StageModule(L.LightningModule):
    """Base class of the stage modules.

    Construction stores and checks the arguments and reads nothing (``--help``, ``--print_config`` and a config
    that fails its checks never touch a weight); :meth:`configure_model`, which Lightning calls inside the
    strategy's context when a fit, validation or test starts, builds the base and every role on it
    (:meth:`build_model`) and, under ``ModelParallelStrategy``, shards it with FSDP2. Outside a Trainer, call
    ``configure_model()`` yourself before using the model. The tokenizer (``tokenizer``) is read on first use:
    the data module needs it before the model is built.

    Lightning checkpoints keep only what trains (adapters, heads, or every weight under full fine-tuning) and
    the optimizer state; a frozen base is loaded again from its own path, so a checkpoint of a LoRA run is
    megabytes, not the size of the model.

    Non-finite values: the loss (:meth:`guard_losses`) and the gradients are checked before every optimizer
    step. A non-finite one stops the run with a :class:`~rlhf_lightning.utils.nonfinite.NonFiniteError` naming the
    step, the loss term or the parameters; with ``optimizer.nonfinite: skip`` the step is skipped
    instead (no update, optimizer state untouched) and counted in ``<metric_prefix>/skipped_steps``. A
    checkpoint with non-finite weights is never written.
    """

    metric_prefix = "stage"  # namespace of the logged metrics
    exported_roles: tuple[str, ...] = ()  # adapters written by the default :meth:`export`
    default_optimizer = OptimizerSettings()  # the ``optimizer`` a dict of some of its fields is taken over

    def __new__(cls, *args: Any, **kwargs: Any) -> StageModule:
        # before __init__'s own TypeError, which names no new key
        if compatibility.MOVED_INTO_GROUPS.keys() & kwargs.keys():
            compatibility.moved_arguments(cls.__name__, kwargs, constructor_arguments(cls))
        return super().__new__(cls)

    def __init__(self, base: BaseModelSpec) -> None:
        super().__init__()
        self.base_spec = base
        self.model: SharedBase | None = None  # built by configure_model
        self._tokenizer = None
        # Frozen base weights are not in the checkpoint; `on_load_checkpoint` checks for what must be.
        self.strict_loading = False
        self.skipped_steps = 0  # optimizer steps skipped for non-finite values (optimizer.nonfinite: skip)
        # The coming optimizer step's loss terms, with where they came from, checked by `guard_step`.
        self._step_losses: list[tuple[str, dict[str, Tensor]]] = []

    # ---- the model ----------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The base's tokenizer (read on first use; no weights are read)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.base_spec)
        return self._tokenizer

    def configure_model(self) -> None:
        """Build the base model and its roles (:meth:`build_model`); under Lightning's ``ModelParallelStrategy``,
        shard it with FSDP2 (see :mod:`rlhf_lightning.models.sharding`): rank 0 reads the weights, the other
        ranks build on the meta device and receive their shards. Does nothing once the model is built."""
        if self.model is not None:
            return
        mesh = sharding_mesh(self._trainer)
        if mesh is None:
            model = self.build_model(empty=False)
        else:
            # The strategy's device: the module itself is moved there only after configure_model. The precision
            # plugin's conversion (bf16-true) too is applied by Lightning later, which a sharded model cannot take.
            model = build_sharded(self.build_model, mesh, lambda built: built.decoder_layers(),
                                  self.trainer.strategy.root_device, self.trainer.precision_plugin.convert_module)
            model.after_sharding()
        model.train()  # from_pretrained and peft give eval mode; with dropout off the two modes compute the same
        self.model = model

    @property
    def datamodule(self) -> Any | None:
        """The trainer's data module; None outside a Trainer, or in a fit given dataloaders instead."""
        return self.trainer.datamodule if self._trainer is not None else None

    @property
    def export_folder(self) -> Path | None:
        """Where ``fit`` exports the model: ``export_dir`` under the run folder (``trainer.default_root_dir``)
        unless absolute; None without an export."""
        return export_path(self._trainer, self.hparams.get("export_dir"))

    def on_fit_end(self) -> None:
        if self.export_folder is not None:
            self.export(self.export_folder)

    def export(self, directory: str | Path) -> dict[str, Path] | Path:
        """Write the trained adapters ``exported_roles`` (and their heads) in peft format under ``directory``; in a
        distributed fit every rank takes part (sharded adapters are gathered) and rank 0 writes."""
        return {role: self.model.save_adapter(role, directory, write=self.is_writer) for role in self.exported_roles}

    def on_train_start(self) -> None:
        # A fresh fit must not write over another run's exports or checkpoints (the command line checks this
        # before the model is built; this covers a Trainer used from Python: only now, once every strategy has
        # restored its checkpoint, does the Trainer say whether it resumed).
        if self.trainer.ckpt_path is None:
            refuse_overwrite(self.trainer, self.export_folder)

    @property
    def ranks(self) -> Ranks:
        """Reductions over the ranks of a distributed fit (the value itself outside one)."""
        return Ranks(self._trainer)

    @property
    def is_writer(self) -> bool:
        """Whether this process writes files (exports): rank 0, or the only process."""
        return self._trainer is None or self.trainer.is_global_zero

    def build_model(self, empty: bool) -> SharedBase:
        """The base with every role of the stage (adapters, heads, reward sources). ``empty``: build the same
        modules on the meta device without reading a weight (see :func:`~rlhf_lightning.models.sharding.
        build_sharded`)."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if stage == "fit" and self._trainer is not None:
            # Before the model is built (the command line checks this earlier still): a folder the fit could not
            # write would lose the run's result at its end.
            refuse_unwritable(self.trainer, self.export_folder)
        if self.datamodule is not None and hasattr(self.datamodule, "longest"):
            self.check_lengths(self.datamodule)

    def check_lengths(self, datamodule: Any) -> None:
        """Before the model is built: the data's longest sequences must fit the model's positions."""
        check_positions(self.base_spec, self.tokenizer, datamodule.longest(), "the longest example of the data",
                        "lower data.init_args.max_length (longer examples are then skipped)")

    def load_base(self, train_base: bool = False, empty: bool = False) -> SharedBase:
        """The base model of ``base``, wrapped as a :class:`SharedBase` (``empty``: on the meta device)."""
        spec = self.base_spec
        return SharedBase(load_causal_lm(spec, self.tokenizer, empty=empty), train_base=train_base,
                          fused_lora=spec.fused_lora)

    def state_dict(self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """What trains (adapters and heads; every weight under full fine-tuning): a frozen base is loaded again
        from its own path, so it is never part of the module's state. Under FSDP2 this is also what the
        strategy gathers for a checkpoint, so the frozen shards are never sent to rank 0."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if all(parameter.requires_grad for parameter in self.parameters()):
            return state
        keep = {prefix + name for name in self.checkpointed_keys()}
        for key in [key for key in state if key.startswith(prefix) and key not in keep]:
            del state[key]
        return state

    def keep_group(self, name: str, value: Any, default: Any) -> Any:
        """A group argument (``sampling``, ``kl``, ``optimizer``) resolved over the module's ``default``
        (:func:`~rlhf_lightning.utils.checks.group_settings`), returned to be kept typed on the module and saved
        plain in the hyper-parameters (a dict, as a config gives it), which checkpoints and loggers read: its
        ``hyperparameters()`` where a group holds code (the episodes' environment), else all its fields."""
        settings = checks.group_settings(name, value, default)
        plain = getattr(settings, "hyperparameters", None)
        self.hparams[name] = plain() if plain is not None else dataclasses.asdict(settings)
        return settings

    def configure_adamw(self, parameter_groups: list[dict], settings: OptimizerSettings,
                        total_steps: int | None = None) -> dict[str, Any]:
        """AdamW over ``parameter_groups`` (each with its ``lr``) with ``settings``' weight decay, epsilon and
        warm-up/decay schedule; ``total_steps`` defaults to the Trainer's estimate."""
        optimizer = adamw(parameter_groups, settings.weight_decay, eps=settings.adam_eps)

        # Asked lazily: reading `estimated_stepping_batches` here would build the train loader before a
        # checkpoint's loader state is restored, and the resumed run would replay the epoch from its start.
        def total() -> int:
            return total_steps if total_steps is not None else int(self.trainer.estimated_stepping_batches)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(settings.schedule, settings.warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- non-finite values ---------------------------------------------------------------------------------

    @property
    def nonfinite_policy(self) -> str:
        """``raise`` (the default) or ``skip``: what a non-finite loss, gradient or reward does."""
        settings = getattr(self, "optimizer_settings", None)
        return "raise" if settings is None else settings.nonfinite

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every training row names its step too, so that the logged names are the same on every row, resumed or
        # not: under automatic optimization the steps before the batch's own, as Lightning logs them (the on-policy
        # loop logs its own in its training step).
        if self.automatic_optimization:
            self.log("trainer/global_step", float(self.global_step))

    def on_validation_epoch_end(self) -> None:
        """Log where in the fit this validation is (subclasses log their metrics, then call this): the row's
        ``trainer/global_step`` is the optimizer steps so far (Lightning's logging step would be the count before the
        last step for a validation inside the epoch, and the iterations for the on-policy loop;
        :class:`~rlhf_lightning.cli.loggers.WandbLogger` writes this value instead), and the on-policy loop's rows get
        their x-axis ``<prefix>/iteration``, the iterations done."""
        if self._trainer is None or self.trainer.state.fn != "fit":
            return
        position = {"trainer/global_step": float(self.global_step)}
        if not self.automatic_optimization:
            done = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed
            position[f"{self.metric_prefix}/iteration"] = float(done)
        self.log_dict(position, sync_dist=True)  # equal on every rank: sync_dist keeps Lightning's advice away

    def training_position(self) -> str:
        """Where training is, for messages: the optimizer step about to be made."""
        if self._trainer is None:
            return "outside a fit"
        return f"optimizer step {self.global_step + 1} (training batch {self.trainer.fit_loop.total_batch_idx})"

    def guard_losses(self, losses: Mapping[str, Tensor], where: str | None = None) -> None:
        """Keep ``losses`` (name -> value) for the check of the coming optimizer step, with ``where`` they came
        from.

        Nothing is checked or raised here: the step's losses and gradients are checked together by
        :meth:`guard_step`, in one pass (one device synchronisation per step, not one per loss term), and under
        DDP every rank must still run its backward before the ranks decide together.
        """
        self._step_losses.append((where or self.training_position(),
                                  {name: value.detach() for name, value in losses.items()}))

    def _gradient_scaler_active(self) -> bool:
        # Under fp16 mixed precision the GradScaler finds scaled-up infinities itself and skips those steps.
        if self._trainer is None:
            return False
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def guard_step(self, where: str | None = None) -> bool:
        """Before an optimizer step: True if it may be taken. Otherwise (a non-finite loss kept by
        :meth:`guard_losses`, or a non-finite gradient, on any rank) raise :class:`NonFiniteError`, or under
        ``optimizer.nonfinite: skip`` drop the gradients, count the skipped step and return False."""
        step_losses, self._step_losses = self._step_losses, []
        losses = [value for _, terms in step_losses for value in terms.values()]
        # Sharded gradients are checked shard by shard: the ranks decide together below.
        named = [] if self._gradient_scaler_active() else [
            (name, local_tensor(p.grad)) for name, p in self.named_parameters() if p.grad is not None]
        problem = None
        if not all_finite(losses + [grad for _, grad in named]):
            problem = first_nonfinite_loss(step_losses)
            if problem is None:
                bad = nonfinite_names(named)
                problem = (f"{where or self.training_position()}: non-finite gradients in {len(bad)} parameters "
                           f"{listing(bad, 3)}")
        found = self.ranks.sum(torch.tensor(float(problem is not None), device=self.device))
        if not bool(found > 0):
            return True
        problem = problem or f"{where or self.training_position()}: a non-finite value on another rank"
        if self.nonfinite_policy != "skip":
            raise NonFiniteError(f"{problem}; {SKIP_HINT}")
        log.warning("%s; optimizer step skipped (optimizer.nonfinite: skip)", problem)
        self.skip_step()
        return False

    def skip_step(self, steps: int = 1) -> None:
        """Count ``steps`` skipped optimizer steps and drop the gradients: optimizers leave a parameter without a
        gradient untouched (no update, no weight decay, no change to Adam's moments)."""
        self.skipped_steps += steps
        for parameter in self.parameters():
            parameter.grad = None

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        with phase("update/backward"):  # every stage's backward passes, automatic and manual optimization alike
            super().backward(loss, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Automatic optimization: Lightning calls this after the backward, before clipping and the step.
        if self.automatic_optimization:
            self.guard_step()
            self.log(f"{self.metric_prefix}/skipped_steps", float(self.skipped_steps))

    # ---- checkpoints --------------------------------------------------------------------------------------

    def checkpointed_keys(self) -> set[str]:
        """State-dict keys a checkpoint must hold: every parameter that trains."""
        return {name for name, parameter in self.named_parameters() if parameter.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CLASS_KEY] = class_path(type(self))  # so that another stage's module refuses the file
        where = "" if self._trainer is None else f" at {self.training_position()}"
        # Under FSDP2 the state is gathered on rank 0; the other ranks hold an empty one.
        check_finite_weights(checkpoint["state_dict"], f"a checkpoint{where}")
        checkpoint["skipped_steps"] = self.skipped_steps
        if "optimizer_states" in checkpoint and self._trainer is not None and not self.model.is_sharded:
            # FSDP2's numbering of the optimizer's parameters (Lightning's own under FSDP2), so that a checkpoint of
            # one process or DDP resumes under FSDP2 too
            checkpoint["optimizer_states"] = [
                numbered_by_module_position(state, optimizer, self)
                for state, optimizer in zip(checkpoint["optimizer_states"], self.trainer.optimizers, strict=True)]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        refusal = class_mismatch(self.trainer.ckpt_path if self._trainer else "(loaded)", checkpoint.get(CLASS_KEY),
                                 type(self))
        if refusal:
            raise CheckpointError(refusal)
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))
        # ModelParallelStrategy loads the weights into the shards itself and hands over the rest of the file.
        saved = (checkpoint["state_dict"].keys() if "state_dict" in checkpoint
                 else saved_state_keys(self.trainer.ckpt_path))
        missing = self.checkpointed_keys() - saved
        if missing:
            raise KeyError(
                f"the checkpoint lacks {len(missing)} trained weights of this model (e.g. {sorted(missing)[0]}); "
                "was it written by a run with another adapter or head configuration?"
            )


class SupervisedStage(StageModule):
    """A stage trained by automatic optimization on a fixed dataset (SFT, the reward model, the PRM): one AdamW
    over the model's trainable weights from the hyper-parameter ``optimizer``, and :meth:`export` to
    ``export_folder`` when the fit ends."""

    def configure_optimizers(self):
        settings = self.optimizer_settings
        return self.configure_adamw([{"params": self.model, "lr": settings.lr}], settings)
