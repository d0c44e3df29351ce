"""What ``python -m rlhf_lightning`` answers before the training stack (torch, Lightning, transformers, peft) is
imported: the command line's help, a ``--config`` file that is missing or not YAML, ``plot``, which reads W&B
files and draws with matplotlib, and a subcommand's ``--help`` or ``--print_config`` asked before with nothing
changed (:mod:`rlhf_lightning.cli.answers`). Everything else goes on to
:func:`rlhf_lightning.cli.command_line.main`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhf_lightning.cli.answers import kept_answer
from rlhf_lightning.cli.errors import config_file_problem, config_files, one_line, user_error, want_traceback

# The command line's own help (``python -m rlhf_lightning --help``); its first paragraph opens every
# subcommand's --help.
HELP = """\
rlhf_lightning: RLHF research on PyTorch Lightning (SFT, reward models, PPO, GRPO and its family, DPO, KTO, online
DPO, distillation) with one frozen base shared by every role through LoRA adapters.

usage: python -m rlhf_lightning SUBCOMMAND [options]

subcommands:
  fit            train a stage: python -m rlhf_lightning fit --config configs/ppo.yaml
  validate       evaluate a model on the validation data (validate --config ... --ckpt_path ...)
  test           run a stage's test loop
  predict        run a stage's predict loop
  merge          fold an adapter into its base as a standalone model (merge --adapter DIR --out DIR)
  evaluate       run lm-evaluation-harness tasks on a model or adapter (evaluate --model DIR --tasks ...)
  plot           draw a run folder's curves as PNG (plot RUN_FOLDER [RUN_FOLDER ...])
  serve-reward   serve a reward source over HTTP (serve-reward --base DIR --reward ...)

python -m rlhf_lightning SUBCOMMAND --help lists a subcommand's options; fit --config FILE --help shows them with
that config's values; --model.help CLASS lists a model class's arguments. Guides: docs/ (README.md's table)."""


def say(line: str) -> None:
    sys.stderr.write(f"{line}\n")  # one write, as the command line's error lines
    sys.stderr.flush()


def answer_early(argv: Sequence[str]) -> int | None:
    """The exit status of a command answered here, or None when it needs the training stack."""
    if list(argv) in ([], ["-h"], ["--help"]):
        print(HELP)
        return 0
    for path in config_files(list(argv)):
        problem = config_file_problem(path)
        if problem:
            say(f"error: {problem}")
            return 2
    if argv[:1] == ["plot"]:
        from rlhf_lightning.runs.plots import main as plot_main

        try:
            plot_main(list(argv[1:]))
        except Exception as error:
            ours = None if want_traceback() else user_error(error)
            if ours is None:
                raise
            say(one_line(ours))
            return 1
        return 0
    answer = kept_answer(argv)
    if answer is not None:
        sys.stdout.write(answer)
        return 0
    return None

