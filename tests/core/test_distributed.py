"""What :mod:`rlhf_lightning.core.distributed` refuses before Lightning starts a second process: a Trainer is built
here with two CPU devices, which starts nothing until a fit."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from rlhf_lightning.core.distributed import check_parallel_sizes


def trainer(**settings) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(**settings), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize("settings, refusal", [
    ({"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": False}, None),
    ({"data_parallel_size": 1, "tensor_parallel_size": 2, "save_distributed_checkpoint": False},
     "with tensor_parallel_size=2: our modules shard the base with FSDP2 over data-parallel ranks"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": True},
     "with save_distributed_checkpoint=true writes a folder per checkpoint"),
    ({"data_parallel_size": 4, "tensor_parallel_size": 1, "save_distributed_checkpoint": False},
     "data_parallel_size=4 x tensor_parallel_size=1 does not match the world size 2"),
])
def test_sizes_tensor_parallelism_and_folder_checkpoints_are_refused_before_any_process_starts(settings, refusal):
    built = trainer(**settings)
    if refusal is None:
        check_parallel_sizes(built)
        return
    with pytest.raises(ValueError, match=refusal.replace("(", r"\(")) as raised:
        check_parallel_sizes(built)
    assert "\n" not in str(raised.value)
