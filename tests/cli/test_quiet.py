"""What the command line keeps out of a run's log: the libraries' tips and vLLM's traceback of a chat-template
warm-up the engine never uses; anything else those loggers say still gets through."""

from __future__ import annotations

import logging

from rlhf_lightning.cli.quiet import quiet_libraries


def records_kept(name: str, messages: list[str]) -> list[str]:
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = Keep()
    logger.addHandler(handler)
    try:
        for message in messages:
            try:
                raise ValueError("template")
            except ValueError:
                logger.warning(message, exc_info=True)
    finally:
        logger.removeHandler(handler)
    return kept


def test_vllm_chat_template_warmup_traceback_is_dropped_and_other_lines_kept():
    quiet_libraries()
    quiet_libraries()  # idempotent: one filter
    assert len(logging.getLogger("vllm.renderers.base").filters) == 1
    assert records_kept("vllm.renderers.base", ["Chat template warmup failed", "Renderer is slow"]) == [
        "Renderer is slow"]


def test_lightning_tips_are_dropped():
    quiet_libraries()
    assert records_kept("lightning.pytorch.utilities.rank_zero", ["💡 Tip: try litlogger", "GPU available: False"]) \
        == ["GPU available: False"]
