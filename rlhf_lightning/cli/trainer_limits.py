"""``--trainer.limit_train_batches=1`` read as one batch, whatever was imported first.

Lightning's Trainer types ``limit_train_batches``, ``limit_val_batches`` and the like ``Optional[Union[int, float]]``
(an int counts batches, a float takes a share), and Fabric types ``clip_val`` ``Optional[Union[float, int]]``. The two
are equal, so typing's cache hands whichever was built first to both, and which one that is depends on what else was
imported before Lightning and how much it used the cache. Built float first, jsonargparse tries float first and
reads ``1`` as ``1.0``: every batch instead of one (seen in a test whose imports changed; nothing said so).
"""

from __future__ import annotations

import typing
from typing import Any

FLOAT_FIRST = (float, int, type(None))


def int_first_trainer_limits() -> list[str]:
    """Give the Trainer's ``int | float | None`` arguments their union with ``int`` first (an int stays an int);
    returns the names that needed it."""
    from lightning.pytorch import Trainer

    annotations: dict[str, Any] = Trainer.__init__.__annotations__
    changed = [name for name, annotation in annotations.items()
               if getattr(annotation, "__origin__", None) is typing.Union
               and tuple(getattr(annotation, "__args__", ())) == FLOAT_FIRST]
    if changed or typing.Optional[typing.Union[int, float]].__args__ != (int, float, type(None)):  # noqa: UP007, UP045 (typing's own union, whose cache is the point)
        # What jsonargparse rebuilds from the arguments must come out int first too: typing's cache must hold the
        # int-first union. Its caches only save time (typing empties them itself when asked: `typing._cleanups`).
        for clear in getattr(typing, "_cleanups", ()):
            clear()
        int_first = typing.Optional[typing.Union[int, float]]  # noqa: UP007, UP045 (typing's own union, whose cache is the point)
        for name in changed:
            annotations[name] = int_first
    return changed
