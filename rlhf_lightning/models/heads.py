"""Scalar heads (value head of the critic, score head of a reward model), kept outside peft as plain modules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"


class ScalarHead(nn.Module):
    """A linear map from a hidden state to one number: a value (critic) or a reward score.

    Computed in float32 whatever the base's dtype, so small value differences are not lost to bf16 rounding.

    Args:
        hidden_size: width of the base model's hidden states.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Small outputs at the start, as in OpenRLHF: a fresh critic should not predict large values.
        nn.init.normal_(self.linear.weight, std=1.0 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[..., hidden] -> [...]``."""
        return self.linear(hidden_states.to(self.linear.weight.dtype)).squeeze(-1)

    def save(self, directory: str | Path) -> None:
        """Write ``head.safetensors`` and ``head_config.json`` into ``directory``."""
        self.save_state(directory, self.state_dict(), self.hidden_size)

    @staticmethod
    def save_state(directory: str | Path, state: dict[str, Tensor], hidden_size: int) -> None:
        """Write a head's ``state`` (its ``state_dict``, gathered when sharded) as :meth:`save` does."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({key: value.detach().contiguous().cpu() for key, value in state.items()}, directory / HEAD_WEIGHTS)
        (directory / HEAD_CONFIG).write_text(json.dumps({"hidden_size": hidden_size}))

    @staticmethod
    def saved_hidden_size(directory: str | Path, expected_hidden_size: int | None = None) -> int:
        """The width of the head saved in ``directory``, checked against the base model's."""
        directory = Path(directory)
        config_path = directory / HEAD_CONFIG
        if not config_path.exists():
            raise FileNotFoundError(f"{config_path} not found: {directory} holds no scalar head")
        hidden_size = json.loads(config_path.read_text())["hidden_size"]
        if expected_hidden_size is not None and hidden_size != expected_hidden_size:
            raise ValueError(
                f"the head in {directory} expects hidden size {hidden_size}, "
                f"but the base model's hidden size is {expected_hidden_size}"
            )
        return hidden_size

    @classmethod
    def load(cls, directory: str | Path, expected_hidden_size: int | None = None) -> ScalarHead:
        """Read a head written by :meth:`save`; check its width against the base model's."""
        directory = Path(directory)
        head = cls(cls.saved_hidden_size(directory, expected_hidden_size))
        head.load_state_dict(load_file(directory / HEAD_WEIGHTS))
        return head

    @staticmethod
    def exists(directory: str | Path) -> bool:
        """Whether ``directory`` holds a saved head."""
        return (Path(directory) / HEAD_CONFIG).exists()
