"""Lightning callbacks of the framework: crash-safe checkpoints and resuming (``checkpoint``), a stop at the next step
on SIGTERM or SIGINT (``preemption``), progress bars (``progress``) and progress lines (``progress_lines``), what a fit
says at its start and end (``run_report``) from what bounds it (``run_shape``), a validation before the first update
(``validate_at_start``), the not-learning check (``learning_check``) and the completions table (``completions``)."""

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
