"""Lightning callbacks of the framework."""

from rlhf_lightning.callbacks.checkpoint import IterationCheckpoint

__all__ = ["IterationCheckpoint"]
