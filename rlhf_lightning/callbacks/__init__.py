"""Lightning callbacks of the framework."""

from rlhf_lightning.callbacks.checkpoint import Checkpoint, IterationCheckpoint
from rlhf_lightning.callbacks.completions import CompletionsTable
from rlhf_lightning.callbacks.learning_check import LearningCheck, NotLearningError
from rlhf_lightning.callbacks.preemption import Preemption
from rlhf_lightning.callbacks.progress_lines import ProgressLines
from rlhf_lightning.callbacks.run_report import RunReport
from rlhf_lightning.callbacks.validate_at_start import ValidateAtStart
from rlhf_lightning.utils.atomic_io import AtomicCheckpointIO, CheckpointError

__all__ = ["AtomicCheckpointIO", "Checkpoint", "CheckpointError", "CompletionsTable", "IterationCheckpoint",
           "LearningCheck", "NotLearningError", "Preemption", "ProgressLines", "RunReport", "ValidateAtStart"]
