"""Quiet logs where we own the process (the command line): what a run prints is what its user needs to read.

Filtered: the libraries' deprecation notices (transformers, Lightning, torch... warn about their own APIs, which we
call, not the user), Lightning's tips about its cloud services, and the libraries' progress bars when the output
is not a terminal (a log file would hold one redrawn line per update), and vLLM's traceback of a failed chat-template
warm-up (the engine is given token ids, never chat messages, so its template is never used). Our own warnings print as one line
``warning: <message>``, without the source line Python adds. ``python -W default`` or ``PYTHONWARNINGS``
restores every warning as Python shows it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
LIBRARIES = r"(transformers|lightning|lightning_fabric|pytorch_lightning|torch|torchmetrics|jsonargparse|wandb|peft|" \
            r"datasets|huggingface_hub|tokenizers)(\.|$)"
TIP = "💡 Tip:"
# Log records dropped whole: logger name -> the messages (as logged, before formatting).
DROPPED = {"vllm.renderers.base": ("Chat template warmup failed",)}


class DropTips(logging.Filter):
    """Drops Lightning's advertisement lines (``💡 Tip: ... try installing litlogger``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(TIP)


class DropMessages(logging.Filter):
    """Drops the records whose message (before formatting) is one of ``messages``."""

    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.messages


def ours(filename: str) -> bool:
    try:
        return PACKAGE in Path(filename).resolve().parents
    except (OSError, ValueError):
        return False


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 (warnings API)
    """``warning: <message>`` for our warnings; Python's own format for the others."""
    stream = file if file is not None else sys.stderr
    text = f"warning: {message}\n" if ours(filename) else warnings.formatwarning(message, category, filename, lineno,
                                                                                 line)
    with contextlib.suppress(OSError, AttributeError):  # no stream to write to: as Python does, say nothing
        stream.write(text)


def quiet_libraries() -> None:
    """Apply the filters above to this process (idempotent)."""
    if not sys.warnoptions:  # -W / PYTHONWARNINGS: the user chose what to see
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
        warnings.showwarning = show_warning
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropTips) for f in logger.filters):
            logger.addFilter(DropTips())
    for name, messages in DROPPED.items():  # loggers made now are the ones the library takes when imported later
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(messages))
    if not sys.stdout.isatty():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except ImportError:  # an older hub without the switch
            pass
