"""The batched episode rollout: every episode of a batch advances one assistant turn per ``generate`` call.

Each turn the policy samples for the episodes still running (episodes finish at different turns; the batch
shrinks, it never falls back to one episode at a time); the turn is parsed for tool calls in the template's
format, the episode's environment answers, and its messages are appended as tokens. Those tokens are rendered by
the chat template as the *delta* after an assistant turn (what the template writes between the turn-end token
and the next assistant header), so the transcript is exactly the generated tokens plus the environment's: decoded
text is never tokenized again (re-tokenizing a model's own output can split it differently and make every ratio
wrong).

The result is laid out as single-turn rollouts are: the opening (chat template with ``tools=``) left-padded, the
episode right-padded after it. ``policy_mask`` marks the policy's tokens; tool and environment tokens are context
only (no loss, KL or entropy on them). The log-probs of the policy tokens from one forward pass over the
transcript equal what the sampler saw turn by turn (the positions come from the attention mask in both).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.data.collate import pad
from rlhf_lightning.episodes.environment import Environment, Message, checked_reset, checked_step
from rlhf_lightning.episodes.tool_calls import HermesFormat, Llama3JsonFormat, ParsedTurn
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.generate import SamplingSettings, sample_responses

# A neutral conversation that the delta of the environment's messages is rendered after.
_BEFORE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


@dataclass
class Episode:
    """One episode while it runs: its opening tokens, the tokens after them and which of those the policy
    sampled, the conversation as messages, and the rewards and counts of its turns."""

    row: int
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


@dataclass(frozen=True)
class EpisodeBatch:
    """Finished episodes as tensors: ``input_ids``/``attention_mask`` ``[B, P + R]`` (opening left-padded,
    episode right-padded), ``policy_mask``, ``turn_rewards`` (each turn's environment reward at the turn's last
    policy token) and ``sampler_logprobs`` ``[B, R]``, and the episodes themselves."""

    input_ids: Tensor
    attention_mask: Tensor
    policy_mask: Tensor
    turn_rewards: Tensor
    sampler_logprobs: Tensor
    episodes: list[Episode]


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


def run_episodes(
    model: SharedBase,
    role: str | None,
    tokenizer: Any,
    environments: Sequence[Environment],
    rows: Sequence[dict[str, Any]],
    row_numbers: Sequence[int],
    settings: SamplingSettings,
    max_turns: int,
    max_episode_tokens: int,
    tool_format: HermesFormat | Llama3JsonFormat | None,
    delta: TemplateDelta,
    draws: Callable[[int, list[int]], Tensor | None] = lambda turn, rows: None,
) -> EpisodeBatch:
    """Run one episode per environment (``rows[i]`` opens episode ``i``; ``row_numbers[i]`` names it in errors)
    until each is done, has taken ``max_turns`` assistant turns, or holds ``max_episode_tokens`` tokens after its
    opening. ``draws(turn, episode indices)``: the sampler's uniform numbers for those episodes' turn (None = the
    global random stream)."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    episodes = []
    for index, (environment, row) in enumerate(zip(environments, rows, strict=True)):
        messages = checked_reset(environment, row, row_numbers[index])
        schemas = [tool.schema for tool in environment.tools.values()]
        episodes.append(Episode(index, environment, opening_ids(tokenizer, messages, schemas), messages))
    for turn in range(1, max_turns + 1):
        running = [episode for episode in episodes if not episode.done]
        if not running:
            break
        room = [max_episode_tokens - len(episode.tokens) for episode in running]
        input_ids, attention_mask = (t.to(device) for t in pad([e.opening + e.tokens for e in running], pad_id,
                                                                   "left"))
        turn_settings = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, max(room)))
        sequences, _, response_mask, logprobs = sample_responses(
            model, role, input_ids, attention_mask, turn_settings, pad_id, draws=draws(turn, [e.row for e in running]),
            with_logprobs=True)
        responses = sequences[:, input_ids.shape[1]:]
        for episode, space, response, keep, sampled in zip(running, room, responses, response_mask, logprobs,
                                                           strict=True):
            new = response[keep].tolist()[:space]
            episode.tokens += new
            episode.policy += [True] * len(new)
            episode.sampler_logprobs += sampled[keep].tolist()[:space]
            episode.turns = turn
            _take_turn(episode, new, turn, settings.stop_token_ids, tool_format, delta, tokenizer, max_turns,
                       max_episode_tokens, row_numbers[episode.row])
    return _as_batch(episodes, pad_id, device)


def _take_turn(episode: Episode, new: list[int], turn: int, stop_ids: tuple[int, ...],
               tool_format: HermesFormat | Llama3JsonFormat | None, delta: TemplateDelta, tokenizer: Any,
               max_turns: int, max_episode_tokens: int, row_number: int) -> None:
    """The environment's answer to the turn just sampled (``new``), appended to ``episode``."""
    if not new or new[-1] not in stop_ids:  # ran out of room mid-turn: nothing to answer
        episode.done = episode.truncated = True
        return
    text = tokenizer.decode(new[:-1], skip_special_tokens=False)
    parsed = tool_format.parse(text) if tool_format is not None else ParsedTurn(text.strip())
    episode.messages.append(assistant_message(parsed))
    step = checked_step(episode.environment, episode.messages, row_number, turn)
    episode.rewards.append((len(episode.tokens) - 1, float(step.reward)))
    episode.counts.update(step.counts)
    if step.done or turn == max_turns:
        episode.done = True
        return
    answer = delta(step.messages)
    if len(episode.tokens) + len(answer) >= max_episode_tokens:  # no room left for another turn
        episode.done = episode.truncated = True
        return
    episode.messages += step.messages
    episode.tokens += answer
    episode.policy += [False] * len(answer)
    episode.sampler_logprobs += [0.0] * len(answer)


def _as_batch(episodes: list[Episode], pad_id: int, device: torch.device) -> EpisodeBatch:
    openings, opening_mask = pad([e.opening for e in episodes], pad_id, "left")
    tokens, present = pad([e.tokens for e in episodes], pad_id, "right")
    policy = torch.zeros_like(tokens, dtype=torch.bool)
    sampler, rewards = torch.zeros_like(tokens, dtype=torch.float32), torch.zeros_like(tokens, dtype=torch.float32)
    for i, episode in enumerate(episodes):
        policy[i, : len(episode.policy)] = torch.tensor(episode.policy, dtype=torch.bool)
        sampler[i, : len(episode.sampler_logprobs)] = torch.tensor(episode.sampler_logprobs)
        for position, reward in episode.rewards:
            rewards[i, position] += reward
    return EpisodeBatch(torch.cat([openings, tokens], 1).to(device), torch.cat([opening_mask, present], 1).to(device),
                        policy.to(device), rewards.to(device), sampler.to(device), episodes)


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
