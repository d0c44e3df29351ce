"""The command line's entry point (``python -m rlhf_lightning`` and the ``rlhf-lightning`` script): what can be
answered without the training stack is answered first (:mod:`rlhf_lightning.cli.early`), the rest goes to
:func:`rlhf_lightning.cli.command_line.main`, whose help and printed configs are kept for next time
(:mod:`rlhf_lightning.cli.answers`)."""

from __future__ import annotations

import sys

from rlhf_lightning.cli.answers import keeping_the_answer
from rlhf_lightning.cli.early import answer_early


def run() -> None:
    """Answer ``sys.argv``: early where the stack is not needed, else through the command line."""
    argv = sys.argv[1:]
    status = answer_early(argv)
    if status is not None:
        sys.exit(status)
    from rlhf_lightning.cli.command_line import main  # the training stack, only where it is needed

    with keeping_the_answer(argv):
        main()
