"""``python -m rlhf_lightning fit|validate|test --config configs/<stage>.yaml`` (LightningCLI, subclass mode)."""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.checkpoint import Checkpoint
from rlhf_lightning.callbacks.crash import CrashCheckpoint, resume_hint
from rlhf_lightning.callbacks.learning_check import LearningCheck
from rlhf_lightning.callbacks.preemption import Preemption
from rlhf_lightning.callbacks.progress import default_progress_bar
from rlhf_lightning.callbacks.progress_lines import ProgressLines
from rlhf_lightning.callbacks.run_report import RunReport, shown_path
from rlhf_lightning.callbacks.spikes import SpikeCheck
from rlhf_lightning.callbacks.throughput import Throughput
from rlhf_lightning.callbacks.validate_at_start import ValidateAtStart
from rlhf_lightning.cli.config_keys import (
    dropped_model_arguments,
    located,
    not_accepted_line,
    nulls_in_groups,
)
from rlhf_lightning.cli.early import HELP
from rlhf_lightning.cli.errors import (
    condense_parser_error,
    config_file_problem,
    config_files,
    error_message,
    one_line,
    suggestion,
    user_error,
    want_traceback,
)
from rlhf_lightning.cli.loggers import WandbLogger
from rlhf_lightning.cli.model_card import write_model_card
from rlhf_lightning.cli.quiet import quiet_libraries
from rlhf_lightning.cli.rank_failures import rank_failures_reported
from rlhf_lightning.cli.trainer_limits import int_first_trainer_limits
from rlhf_lightning.core.distributed import check_parallel_sizes, fill_sharding_defaults
from rlhf_lightning.runs.plots import main as plot_main
from rlhf_lightning.runs.plots import plot_run
from rlhf_lightning.runs.resume import (
    class_mismatch,
    differences_warning,
    finished_run,
    hparam_differences,
    import_class,
    last_checkpoint,
    load_for_comparison,
    quiet_resume,
    saved_class_of,
)
from rlhf_lightning.runs.run_folder import (
    export_path,
    holds_files,
    refuse_overwrite,
    refuse_unwritable,
    remove_if_empty,
    resume_without_checkpoint,
)
from rlhf_lightning.utils.atomic_io import CheckpointError
from rlhf_lightning.utils.machine import busy_machine_warning

# `ckpt_path` values that Lightning resolves itself rather than naming a file.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc")


def print_error(line: str) -> None:
    """``line`` on stderr in one write: the ranks of a distributed run print theirs at the same moment, and a
    separate write of the newline would let another rank's line land in the middle."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


class LogConfigCallback(SaveConfigCallback):
    """Saves the fully resolved config next to the run and stores it in the W&B run's config."""

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and not isinstance(logger.experiment.config, dict):
                logger.experiment.config.update({"cli": config}, allow_val_change=True)


class OneLineArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors are one line (``error: model.init_args.lr: Expected a <class
    'float'>. Got value: abc``) instead of the usage and jsonargparse's nested union report;
    ``RLHF_LIGHTNING_TRACEBACK=1`` restores the full report. Abbreviated options are refused: argparse would
    otherwise take ``--trainer.max_step`` for ``--trainer.max_steps`` without a word."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    config_files: list[str] = []  # the command's --config files (set by given()): where a refused key sits
    command_line: list[str] = []  # the command's arguments (set by given()): a key they set is not the files'

    @classmethod
    def given(cls, argv: list[str]) -> None:
        """Keep the command's arguments and its config files, for the lines about what they set."""
        cls.command_line, cls.config_files = list(argv), config_files(argv)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or want_traceback():
            super().error(message, ex)
        line = not_accepted_line(message, self.option_names(), suggestion) or condense_parser_error(
            message, self.option_names())
        print_error(f"error: {located(line, self.config_files, self.command_line)}")
        sys.exit(2)

    def option_names(self) -> list[str]:
        """Every ``--option`` of this parser and its subcommands' (for the closest name to a misspelled one)."""
        names = [option for action in self._actions for option in action.option_strings]
        for action in self._actions:
            for parser in (getattr(action, "choices", None) or {}).values():
                if isinstance(parser, LightningArgumentParser):
                    names += [option for sub in parser._actions for option in sub.option_strings]
        return names


class RLHFCLI(LightningCLI):
    """LightningCLI for every stage: ``model`` and ``data`` are chosen by ``class_path`` in the config.

    Unlike LightningCLI, ``--ckpt_path`` never replaces the config's model arguments with the checkpoint's
    (see :mod:`rlhf_lightning.runs.resume`): a checkpoint of another module class is refused, and differences are
    listed in a warning. ``--ckpt_path last`` resolves to a complete checkpoint (see
    :class:`rlhf_lightning.callbacks.Checkpoint`) before anything is compared or loaded.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        self.argv = list(sys.argv[1:] if args is None else args)  # for the exports' model card
        OneLineArgumentParser.given(self.argv)
        given = nulls_in_groups(self.argv)
        if given != self.argv:
            args = given
        int_first_trainer_limits()  # --trainer.limit_train_batches=1 is one batch, not all of them
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=LogConfigCallback,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"logger": {"class_path": "rlhf_lightning.cli.loggers.WandbLogger"}},
            parser_class=OneLineArgumentParser,
            parser_kwargs={"prog": "python -m rlhf_lightning", "description": HELP.split("\n\n")[0]},
            args=args,
            run=run,
        )

    def before_instantiate_classes(self) -> None:
        # A model class switched on the command line keeps only the config's arguments it takes: say which went.
        config = self.config[self.subcommand] if self.subcommand else self.config
        model = config.get("model")
        if model is not None and model.get("class_path"):
            dropped = dropped_model_arguments(OneLineArgumentParser.config_files, model["class_path"],
                                              list((model.get("init_args") or {}).keys()))
            if dropped:
                rank_zero_warn(dropped)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Callbacks every fit gets, set from the top level (``--validate_at_start.enabled false``).
        parser.add_lightning_class_args(ValidateAtStart, "validate_at_start")
        parser.add_lightning_class_args(LearningCheck, "not_learning")
        parser.add_lightning_class_args(SpikeCheck, "spikes")
        parser.add_lightning_class_args(Throughput, "throughput")  # tokens/s, MFU, phases' shares: perf/*

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would load the checkpoint's hyper-parameters into the config here. The config wins;
        # an explicit file is checked now, before any model is built.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and str(ckpt_path) not in SPECIAL_CKPT_PATHS:
            self.check_checkpoint_against_config(subcommand, ckpt_path)

    def check_checkpoint_against_config(self, subcommand: str, ckpt_path: str) -> dict[str, Any]:
        """Refuse a checkpoint of another module class; warn with the list of model arguments that differ; the
        checkpoint (memory-mapped)."""
        model = self.resolved_config(subcommand).get("model") or {}
        model_class = import_class(model.get("class_path", ""))
        checkpoint = load_for_comparison(ckpt_path)
        if model_class is not None:
            refusal = class_mismatch(ckpt_path, saved_class_of(checkpoint), model_class)
            if refusal:
                raise CheckpointError(refusal)
        saved = checkpoint.get("hyper_parameters") or {}
        message = differences_warning(ckpt_path, hparam_differences(saved, model.get("init_args") or {}))
        if message:
            rank_zero_warn(message)
        return checkpoint

    def resolved_config(self, subcommand: str) -> dict[str, Any]:
        """The subcommand's config as the run saves it (every default filled in), as plain YAML data."""
        return yaml.safe_load(self.parser.dump(self.config, skip_none=False, skip_link_targets=False))[subcommand]

    def _run_subcommand(self, subcommand: str) -> None:
        check_parallel_sizes(self.trainer)  # before Lightning starts the other processes
        busy = busy_machine_warning() if subcommand == "fit" else None
        if busy:
            rank_zero_warn(busy)
        ckpt_path = self.config_init[subcommand].get("ckpt_path")
        checkpoint = None
        if ckpt_path == "last":
            resolved = last_checkpoint(self.trainer, subcommand)
            if resolved:
                checkpoint = self.check_checkpoint_against_config(subcommand, str(resolved))
            elif subcommand == "fit":
                resume_without_checkpoint(self.trainer, export_path(self.trainer, getattr(
                    self.model, "hparams", {}).get("export_dir")))
            self.config_init[subcommand]["ckpt_path"] = ckpt_path = resolved  # resolved once: one warning, one file
        if subcommand == "fit" and ckpt_path and str(ckpt_path) not in SPECIAL_CKPT_PATHS:
            checkpoint = checkpoint or load_for_comparison(ckpt_path)
            done = finished_run(checkpoint, self.trainer.max_epochs, self.trainer.max_steps)
            export = export_path(self.trainer, getattr(self.model, "hparams", {}).get("export_dir"))
            if done and (export is None or holds_files(export)):
                # a fit would re-export, rewrite the model card without its results and start an empty run
                print(f"nothing to train: checkpoint {shown_path(Path(ckpt_path))} is of a finished run ({done}); raise "
                      "trainer.max_epochs or trainer.max_steps to train further", flush=True)
                return
            if done:  # stopped after its last checkpoint, before its fit's end: the fit's end exports, nothing trains
                print(f"checkpoint {shown_path(Path(ckpt_path))} is of a finished run ({done}) whose export "
                      f"{shown_path(export)} is missing: exporting it from the checkpoint, nothing trains", flush=True)
        if subcommand == "fit" and not ckpt_path:
            # Before the model is built: a fresh run must not write over another run's exports or checkpoints.
            refuse_overwrite(self.trainer, export_path(self.trainer, getattr(self.model, "hparams", {}).get(
                "export_dir")))
        run_folder = Path(self.trainer.default_root_dir)
        had_files = holds_files(run_folder)
        try:
            # One line on every rank when one fails or disappears; no "directory not empty" on a resume.
            with rank_failures_reported(self.trainer), quiet_resume(ckpt_path):
                super()._run_subcommand(subcommand)
        except BaseException:
            if subcommand == "fit" and not had_files and self.trainer.is_global_zero:
                remove_if_empty(run_folder)  # a fit that failed before writing anything leaves no empty folder
            raise
        reports = [callback for callback in self.trainer.callbacks if isinstance(callback, RunReport)]
        for report in reports:
            if not report.print_at_fit_end and report.summary_text:
                print(report.summary_text, flush=True)
        if subcommand == "fit" and self.trainer.is_global_zero:
            export = getattr(self.model, "export_folder", None)
            if export is not None and Path(export).is_dir():
                problem = after_the_fit(lambda: write_model_card(
                    self.trainer, self.model, self.argv, reports[0].change_text() if reports else "",
                    (self.resolved_config(subcommand).get("data") or {}).get("init_args"),
                    (self.resolved_config(subcommand).get("model") or {}).get("init_args")))
                if problem:
                    print(f"  model card: not written ({problem})", flush=True)
            paths: list[Path] = []
            problem = after_the_fit(lambda: paths.extend(plot_run(self.trainer.default_root_dir)))
            drawn = " · ".join(shown_path(path) for path in paths) or "none (no metric to plot)"
            print(f"  plots: {f'none ({problem})' if problem else drawn}", flush=True)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
        # A callback of the top-level groups (validate_at_start, not_learning, spikes) that the config also lists in
        # trainer.callbacks is the config's: once.
        configured = list(config.get("callbacks") or [])
        if config.get("enable_checkpointing") is False:  # Lightning would refuse the config's checkpoint callbacks
            left_out = [type(c).__name__ for c in configured if isinstance(c, ModelCheckpoint)]
            config["callbacks"] = configured = [c for c in configured if not isinstance(c, ModelCheckpoint)]
            if left_out:
                warnings.warn(f"trainer.enable_checkpointing=false: the config's checkpoint callbacks "
                              f"({', '.join(left_out)}) are left out; this run writes no checkpoint", UserWarning,
                              stacklevel=1)
        callbacks = [c for c in callbacks if not (isinstance(c, ValidateAtStart | LearningCheck | SpikeCheck)
                                                  and any(isinstance(o, type(c)) for o in configured))]
        listed = configured + list(callbacks)

        def missing(kind: type) -> bool:
            return not any(isinstance(c, kind) for c in listed)

        if config.get("enable_progress_bar") is not False and missing(ProgressBar) and missing(ProgressLines):
            if sys.stdout.isatty():
                # Lightning's default bar reads "Epoch 0/-2" in a run bounded by max_steps; ours counts its steps.
                callbacks = [*callbacks, default_progress_bar()]
            else:  # a log file would show a bar only when the run ends: plain lines instead
                config["enable_progress_bar"] = False
                callbacks = [*callbacks, ProgressLines()]
        if missing(Preemption):  # a signal ends the fit with a checkpoint
            callbacks = [*callbacks, Preemption()]
        if missing(CrashCheckpoint):  # so does an error in an iteration's rollout
            callbacks = [*callbacks, CrashCheckpoint()]
        if missing(RunReport):  # printed by _run_subcommand, after the loggers' own last words
            callbacks = [*callbacks, RunReport(print_at_fit_end=False)]
        config["strategy"] = strategy_instance(config.get("strategy"))
        trainer = super()._instantiate_trainer(config, callbacks)
        fill_sharding_defaults(trainer, " ".join([*self.argv, *(Path(path).read_text(errors="replace") for path in
                                                                 OneLineArgumentParser.config_files
                                                                 if Path(path).is_file())]))
        if self.subcommand == "fit":  # before the loggers make the run folder: one line instead of mkdir's traceback
            refuse_unwritable(trainer, export_path(trainer, getattr(self.model, "hparams", {}).get("export_dir")))
        # The run folder: loggers and checkpoint callbacks given no folder of their own write under it.
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.use_run_folder(trainer.default_root_dir)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, Checkpoint):
                callback.use_run_folder(trainer)
        return trainer


def strategy_instance(strategy: Any) -> Any:
    """A strategy given as the import path of its class alone (``lightning.pytorch.strategies.
    ModelParallelStrategy``), which jsonargparse passes on as a string Lightning does not know, as an instance of
    that class; anything else as it is."""
    from lightning.pytorch.strategies import Strategy

    if isinstance(strategy, str) and "." in strategy:
        cls = import_class(strategy)
        if isinstance(cls, type) and issubclass(cls, Strategy):
            return cls()
    return strategy


def after_the_fit(action: Callable[[], Any]) -> str | None:
    """Run ``action`` (the model card, the pictures) once the fit's result is saved: why it failed, as a short
    text, or None. Such extras never turn a finished fit into a failed one."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the run's result is already written
        return error_message(error)
    return None


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m rlhf_lightning`` and the ``rlhf-lightning`` script.

    ``fit``, ``validate``, ``test`` and ``predict`` go to LightningCLI; ``merge`` folds an adapter into its base,
    ``evaluate`` runs lm-eval tasks; ``plot`` draws a run folder's curves; ``serve-reward`` serves a reward source.
    An error of ours (a bad argument, file or checkpoint) is printed as one line ``error: ...`` and exits with
    status 1 (2 for an unreadable config file); ``RLHF_LIGHTNING_TRACEBACK=1`` shows the full traceback instead.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv in ([], ["-h"], ["--help"]):
        print(HELP)
        return
    if args is None:  # this process is ours (not a caller's, such as a test runner's): quiet the libraries
        quiet_libraries()
    OneLineArgumentParser.given(argv)
    for path in config_files(argv):
        problem = config_file_problem(path)
        if problem:
            print_error(f"error: {problem}")
            sys.exit(2)
    try:
        if argv[:1] in (["merge"], ["evaluate"]):  # cli/merge_command.py, cli/evaluate_command.py
            from importlib import import_module
            import_module(f"rlhf_lightning.cli.{argv[0]}_command").main(argv[1:])
            return
        if argv[:1] == ["plot"]:
            plot_main(argv[1:])
            return
        if argv[:1] == ["serve-reward"]:
            from rlhf_lightning.serving.command import main as serve_main

            serve_main(argv[1:], OneLineArgumentParser)
            return
        RLHFCLI(args=None if args is None else argv)
    except SIGTERMException:
        # Lightning's own handling (outside a fit's training, where Preemption takes over) ends with status 0.
        print_error("error: stopped by SIGTERM outside a training step (nothing to save)")
        sys.exit(128 + signal.SIGTERM)
    except Exception as error:
        ours = None if want_traceback() else user_error(error)
        hint = resume_hint(error)
        if ours is None:
            if hint:  # before the traceback: what was saved of the run
                print_error(f"error: {hint}")
            raise
        print_error(one_line(ours) + (f" ({hint})" if hint else ""))
        sys.exit(1)


if __name__ == "__main__":
    main()
