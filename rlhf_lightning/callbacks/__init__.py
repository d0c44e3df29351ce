"""Lightning callbacks of the framework: crash-safe checkpoints (``checkpoint``), a checkpoint of the last completed
iteration when one fails (``crash``), the completions table
(``completions``), the not-learning check (``learning_check``), a checkpoint on SIGTERM (``preemption``), progress bars
(``progress``) and plain progress lines (``progress_lines``), the run's start and end report (``run_report``) with
what bounds the fit (``run_shape``), the KL spike warning (``spikes``) and its replay over
logged histories (``spike_replay``), tokens per second, MFU and the phases'
shares (``throughput``), lm-eval tasks on the policy during the fit (``lm_evaluation``), and a validation before the
first update (``validate_at_start``)."""

from rlhf_lightning.callbacks.checkpoint import Checkpoint, IterationCheckpoint
from rlhf_lightning.callbacks.completions import CompletionsTable
from rlhf_lightning.callbacks.crash import CrashCheckpoint
from rlhf_lightning.callbacks.learning_check import LearningCheck, NotLearningError
from rlhf_lightning.callbacks.lm_evaluation import LMEvaluation
from rlhf_lightning.callbacks.preemption import Preemption
from rlhf_lightning.callbacks.progress_lines import ProgressLines
from rlhf_lightning.callbacks.run_report import RunReport
from rlhf_lightning.callbacks.spikes import SpikeCheck
from rlhf_lightning.callbacks.throughput import Throughput
from rlhf_lightning.callbacks.validate_at_start import ValidateAtStart
from rlhf_lightning.utils.atomic_io import AtomicCheckpointIO, CheckpointError

__all__ = ["AtomicCheckpointIO", "Checkpoint", "CheckpointError", "CompletionsTable", "CrashCheckpoint",
           "IterationCheckpoint",
           "LearningCheck", "LMEvaluation", "NotLearningError", "Preemption", "ProgressLines", "RunReport",
           "SpikeCheck", "Throughput", "ValidateAtStart"]
