"""The stages' LightningDataModules, importable from here as configs name them
(``rlhf_lightning.data.modules.PromptDataModule``; the package root exports them too): SFT demonstrations and
step-labelled responses (``demonstrations``), preference pairs and labelled responses (``preferences``) and prompts
for RL (``prompts``), all built on :class:`StageDataModule` (``stage_data``).

Each reads rows from ``dataset`` (the embedded ``synthetic`` task, a JSONL/JSON/Parquet file, a folder or a
``datasets`` hub id), checks and tokenizes every row once in ``setup``, and serves resumable training batches.
The tokenizer is the LightningModule's, so model and data can never disagree on it.
"""

from __future__ import annotations

from rlhf_lightning.data.demonstrations import SFTDataModule, StepwiseDataModule
from rlhf_lightning.data.preferences import PreferenceDataModule, UnpairedPreferenceDataModule
from rlhf_lightning.data.prompts import PromptDataModule
from rlhf_lightning.data.stage_data import SYNTHETIC, UNKNOWN_SHARE_WARNING, StageDataModule, token_ids

__all__ = ["SYNTHETIC", "UNKNOWN_SHARE_WARNING", "PreferenceDataModule", "PromptDataModule", "SFTDataModule",
           "StageDataModule", "StepwiseDataModule", "UnpairedPreferenceDataModule", "token_ids"]
