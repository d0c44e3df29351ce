"""Lightning callbacks of the framework."""

from rlhf_lightning.callbacks.checkpoint import IterationCheckpoint
from rlhf_lightning.callbacks.completions import CompletionsTable

__all__ = ["CompletionsTable", "IterationCheckpoint"]
