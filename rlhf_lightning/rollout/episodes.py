"""What an episode is made of: its opening, the policy's turns and the environment's answers, as token ids.

Each assistant turn is parsed for tool calls in the template's format, the episode's environment answers, and its
messages are appended as tokens. Those tokens are rendered by the chat template as the *delta* after an assistant
turn (what the template writes between the turn-end token and the next assistant header), so the transcript is
exactly the generated tokens plus the environment's: decoded text is never tokenized again (re-tokenizing a
model's own output can split it differently and make every ratio wrong). The turn loop that samples the turns is
:class:`~rlhf_lightning.rollout.rollouts.Rollouts`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.data.collate import pad
from rlhf_lightning.environments.environment import Environment, Message
from rlhf_lightning.environments.tool_calls import ParsedTurn

# A neutral conversation that the delta of the environment's messages is rendered after.
_BEFORE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


@dataclass
class Episode:
    """One episode while it runs: its opening tokens, the tokens after them and which of those the policy
    sampled, the conversation as messages, and the rewards and counts of its turns."""

    index: int  # the episode's number in its rollout
    environment: Environment
    opening: list[int]
    messages: list[Message]
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)  # the sampler's, 0 on the environment's tokens
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (token index, reward) at each turn's end
    counts: Counter = field(default_factory=Counter)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    row_number: int = 0  # its prompt's row in the dataset, from 1 (names it in errors)


class TemplateDelta:
    """Token ids of messages appended after an assistant turn, as the chat template renders them, up to and
    including the next assistant header."""

    def __init__(self, tokenizer: Any, turn_end_id: int) -> None:
        self.tokenizer = tokenizer
        self.turn_end = tokenizer.decode([turn_end_id])
        before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
        if self.turn_end not in before:
            raise ValueError(f"the chat template does not end an assistant turn with {self.turn_end!r}")
        self.before = before

    def __call__(self, messages: list[Message]) -> list[int]:
        full = self.tokenizer.apply_chat_template(_BEFORE + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.before):
            raise ValueError("the chat template renders an earlier turn differently once more messages follow, "
                             "so the environment's tokens cannot be appended to the generated ones")
        # The sampled turn ends at the turn-end token; whatever the template writes after it belongs to the delta.
        after_turn_end = self.before[self.before.rindex(self.turn_end) + len(self.turn_end):]
        return self.tokenizer(after_turn_end + full[len(self.before):], add_special_tokens=False)["input_ids"]


def opening_ids(tokenizer: Any, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """The opening messages as the chat template renders them (with the tools' schemas), up to the first
    assistant header."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_message(parsed: ParsedTurn) -> Message:
    """The policy's turn as a message: its text, its readable calls, and the errors of the others."""
    return {"role": "assistant", "content": parsed.content,
            "tool_calls": [call.as_message_call() for call in parsed.calls if call.error is None],
            "invalid_tool_calls": [call.error for call in parsed.calls if call.error is not None]}


def episode_tensors(episodes: list[Episode], pad_id: int, device: torch.device) -> tuple[Tensor, ...]:
    """Finished episodes as ``(input_ids, attention_mask [B, P + R]`` (opening left-padded, episode right-padded),
    ``policy_mask, turn_rewards, sampler_logprobs [B, R])``: the policy's tokens, each turn's environment reward at
    the turn's last policy token, the sampler's log-probs (0 on the environment's tokens)."""
    openings, opening_mask = pad([e.opening for e in episodes], pad_id, "left")
    tokens, present = pad([e.tokens for e in episodes], pad_id, "right")
    policy = torch.zeros_like(tokens, dtype=torch.bool)
    sampler, rewards = torch.zeros_like(tokens, dtype=torch.float32), torch.zeros_like(tokens, dtype=torch.float32)
    for i, episode in enumerate(episodes):
        policy[i, : len(episode.policy)] = torch.tensor(episode.policy, dtype=torch.bool)
        sampler[i, : len(episode.sampler_logprobs)] = torch.tensor(episode.sampler_logprobs)
        for position, reward in episode.rewards:
            rewards[i, position] += reward
    return (torch.cat([openings, tokens], 1).to(device), torch.cat([opening_mask, present], 1).to(device),
            policy.to(device), rewards.to(device), sampler.to(device))


def episode_values(episodes: Sequence[Episode]) -> dict[str, Tensor]:
    """Per-episode values of held-out episodes: ``turns``, ``tool_calls``, ``tool_errors``, ``invalid_tool_calls``."""
    values = {"turns": torch.tensor([float(episode.turns) for episode in episodes])}
    for name in ("tool_calls", "tool_errors", "invalid_tool_calls"):
        values[name] = torch.tensor([float(episode.counts[name]) for episode in episodes])
    return values


def episode_statistics(episodes: Sequence[Episode]) -> dict[str, Tensor]:
    """Per-episode means: turns, tool calls (all and per tool), tool errors and invalid calls, tool error rate,
    policy and environment tokens, truncated episodes, the environment's reward."""
    count = len(episodes)
    totals: Counter = Counter()
    for episode in episodes:
        totals.update(episode.counts)
    stats = {
        "episode/turns": sum(e.turns for e in episodes) / count,
        "episode/policy_tokens": sum(sum(e.policy) for e in episodes) / count,
        "episode/env_tokens": sum(len(e.policy) - sum(e.policy) for e in episodes) / count,
        "episode/truncated": sum(e.truncated for e in episodes) / count,
        "episode/tool_calls": totals["tool_calls"] / count,
        "episode/invalid_tool_calls": totals["invalid_tool_calls"] / count,
        "episode/tool_error_rate": totals["tool_errors"] / max(totals["tool_calls"], 1),
        "episode/env_reward": sum(reward for e in episodes for _, reward in e.rewards) / count,
    }
    for name, value in totals.items():
        if name.startswith("tool_calls/"):
            stats[f"episode/{name}"] = value / count
    return {name: torch.tensor(float(value)) for name, value in stats.items()}


def transcript_text(tokenizer: Any, episode: Episode) -> str:
    """The episode after its opening, its environment's parts in ``[[...]]`` (for tables of completions)."""
    pieces, start = [], 0
    for by_policy, run in groupby(episode.policy):
        end = start + len(list(run))
        text = tokenizer.decode(episode.tokens[start:end], skip_special_tokens=True).strip()
        pieces.append(text if by_policy else f"[[{text}]]")
        start = end
    return " ".join(piece for piece in pieces if piece)
