"""Rollouts: one draw of ``group`` responses per prompt without an environment, or episodes of turns with one.

A single-turn rollout is one call of the sampler (no episode, no turn loop): ``group`` responses to each prompt,
each prompt encoded once for its group. Episodes start the same way (turn 1); each turn is then parsed for tool
calls in the template's format, the episode's environment (made anew for every episode) answers, its tokens are
appended (:class:`~rlhf_lightning.rollout.episodes.TemplateDelta`) and the episodes still running take their next
turn together (the batch shrinks as episodes finish; it never falls back to one episode at a time).

The result, :class:`Rollout`, is laid out the same way for both: the opening left-padded, the response or episode
right-padded after it, ``response_mask`` on the policy's tokens only (an environment's tokens are context: no
loss, KL or entropy on them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.environments.environment import (
    Environment,
    checked_reset,
    checked_step,
    not_an_environment,
)
from rlhf_lightning.environments.tool_calls import ParsedTurn, detect_format
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.episodes import (
    Episode,
    TemplateDelta,
    assistant_message,
    episode_tensors,
    opening_ids,
)
from rlhf_lightning.rollout.sampler import Drawn, Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import stopped


@dataclass(frozen=True)
class Rollout:
    """What one rollout sampled: ``B`` rows, ``P`` left-padded opening tokens, ``R`` right-padded tokens after them.
    Rows of one prompt are consecutive."""

    input_ids: Tensor  # [B, P + R]
    attention_mask: Tensor  # [B, P + R] 1 on real tokens
    response_mask: Tensor  # [B, R] bool: the policy's tokens (a response, or an episode's assistant turns)
    read_mask: Tensor  # [B, R] bool: what reward sources read: every token after the opening
    sampler_logprobs: Tensor  # [B, R] the sampler's log-probs of the policy's tokens, 0 elsewhere
    is_stopped: Tensor  # [B] bool: the last policy token is a stop token (not cut off by a token limit)
    turn_rewards: Tensor | None = None  # [B, R] an environment's reward at the last policy token of each turn
    episodes: list[Episode] | None = None  # with an environment: the episodes themselves

    @property
    def responses(self) -> Tensor:
        """``[B, R]`` the tokens after the openings."""
        return self.input_ids[:, self.input_ids.shape[1] - self.response_mask.shape[1]:]


class Rollouts:
    """Runs rollouts of prompts: one turn, or episodes with an environment.

    Args:
        sampler: draws the tokens.
        tokenizer: the policy's tokenizer (chat template, padding, stop tokens' text).
        environment: called once per episode for a fresh :class:`~rlhf_lightning.environments.Environment`; None =
            single-turn rollouts.
        max_turns: assistant turns per episode at most.
        max_tokens: tokens per episode after its opening (the policy's and the environment's) at most.
    """

    def __init__(self, sampler: Sampler, tokenizer: Any, environment: Callable[[], Environment] | None = None,
                 max_turns: int = 1, max_tokens: int | None = None) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.environment = environment
        self.max_turns = max_turns if environment is not None else 1
        self.max_tokens = max_tokens or self.max_turns * sampler.settings.max_new_tokens
        self.tool_format = self.delta = None
        self.tool_schemas: list[dict] = []
        self._probe: Environment | None = None  # kept, closed, to release what the episodes share at the end
        if environment is not None:
            # The template's tool-call format and turn delimiters, read once: a template we cannot parse stops the
            # run here, naming itself.
            probe = environment()
            if not isinstance(probe, Environment):
                made = type(probe)
                raise TypeError(f"episodes.environment: {not_an_environment(f'{made.__module__}.{made.__qualname__}')}")
            self._probe = probe
            try:
                self.tool_format = detect_format(tokenizer) if probe.tools else None
                self.tool_schemas = [tool.schema for tool in probe.tools.values()]
            finally:
                probe.close()
            self.delta = TemplateDelta(tokenizer, completion_end_id(tokenizer, conversational=True))

    def with_sampler(self, sampler: Sampler) -> Rollouts:
        """This turn loop drawing with ``sampler``: what the environment's probe read (the tool-call format, the
        schemas, the template's turn delimiters) is shared, not read again."""
        other = copy.copy(self)
        other.sampler = sampler
        return other

    def close(self) -> None:
        """The fit has ended: the environment releases what its episodes shared (a server the fit started)."""
        if self._probe is not None:
            self._probe.close_shared()

    def default_opening_length(self, prompt: Any) -> int:
        """Tokens of the opening of an episode on ``prompt`` whose environment keeps :meth:`Environment.reset`'s
        default: the prompt under the chat template, with the tools' schemas."""
        messages = Environment.reset(Environment(), {"prompt": prompt})
        return len(opening_ids(self.tokenizer, messages, self.tool_schemas))

    def positions(self, opening: int) -> int:
        """The most positions a turn reaches after an opening of ``opening`` tokens. The running episodes of a
        batch decode their turn together, for as many tokens as the one with the most room left may take (at most
        ``max_new_tokens``), so an episode that has used all but one of its ``max_tokens`` (it takes another turn
        only while it has room) decodes that many more before its tokens past the budget are dropped."""
        started = self.max_tokens - 1 if self.max_turns > 1 else 0
        return opening + started + min(self.sampler.settings.max_new_tokens, self.max_tokens)

    def reach(self, prompt: Any) -> tuple[int, str]:
        """The most positions an episode on ``prompt`` (the longest) reaches (:meth:`positions` after its default
        opening: the chat template's markers and the tools' schemas included), and what they are, for a message."""
        opening = self.default_opening_length(prompt)
        budget, turn = self.max_tokens, min(self.sampler.settings.max_new_tokens, self.max_tokens)
        what = (f"the longest prompt's opening ({opening} tokens) and an episode of {budget} tokens (a turn can "
                f"start after {budget - 1} of them and decode {turn} more: sampling.max_new_tokens)"
                if self.max_turns > 1 else
                f"the longest prompt's opening ({opening} tokens) and a turn of {turn} tokens")
        return self.positions(opening), what

    @torch.no_grad()
    def run(self, model: SharedBase, role: str | None, prompts: dict[str, Any], group: int, purpose: str,
            first_turn_seeds: list[int] | None = None) -> Rollout:
        """``group`` responses (or episodes) to each prompt of a data module's batch (``input_ids``,
        ``attention_mask``, ``prompt``, ``raw_prompt``, ``columns``, ``index``), sampled from ``role``; ``purpose``
        names the random streams of ``seed_scope: prompt``. ``first_turn_seeds``: the seed of each response (its
        episode's first turn) given as it is, the later turns' derived from it: a producer thread's, which must not
        draw from the global stream (:meth:`~rlhf_lightning.rollout.seeds.Seeds.ahead`); None = as ``seed_scope``
        says."""
        given = first_turn_seeds is not None
        seeds = first_turn_seeds if given else self.sampler.seeds.rows(purpose, prompts.get("index"), group)
        if self.environment is None:
            drawn = self.sampler.draw(model, role, prompts["input_ids"], prompts["attention_mask"], group,
                                      seeds if given else Seeds.turn(seeds, 1))
            return Rollout(drawn.sequences, drawn.attention_mask, drawn.mask, drawn.mask, drawn.logprobs,
                           stopped(drawn.tokens, drawn.mask, self.sampler.settings.stop_token_ids))
        if model.is_sharded and self.sampler.sharded_rollout == "per_layer":
            raise ValueError("episodes need sharded_rollout: gathered (ranks finish their episodes at different "
                             "turns, so they cannot gather layers in step)")
        episodes: list[Episode] = []
        device = prompts["input_ids"].device
        try:
            self.open_episodes(prompts, group, episodes)
            for turn in range(1, self.max_turns + 1):
                running = [episode for episode in episodes if not episode.done]
                if not running:
                    break
                group_of_turn = group if turn == 1 and _openings_agree(running, group) else 1
                self.take_turn(running, self.draw_turn(model, role, running, group_of_turn, turn, seeds, device,
                                                              given and turn == 1),
                               turn)
        finally:  # every episode has ended, however: its environment releases what it held (an OpenEnv session)
            for episode in episodes:
                episode.environment.close()
        input_ids, attention_mask, policy, turn_rewards, sampler_logprobs = episode_tensors(
            episodes, self.tokenizer.pad_token_id, device)
        responses = input_ids[:, input_ids.shape[1] - policy.shape[1]:]
        return Rollout(input_ids, attention_mask, policy, attention_mask[:, -policy.shape[1]:].bool(),
                       sampler_logprobs, stopped(responses, policy, self.sampler.settings.stop_token_ids),
                       turn_rewards, episodes)

    def open_episodes(self, prompts: dict[str, Any], group: int,
                      episodes: list[Episode] | None = None) -> list[Episode]:
        """``group`` episodes per prompt (consecutive), each with a fresh environment reset on its dataset row,
        appended to ``episodes`` as they open (so that a failure leaves the opened ones for the caller to close)."""
        raw = prompts.get("raw_prompt", prompts["prompt"])
        columns = prompts.get("columns", {})
        numbers = prompts.get("index")
        episodes = [] if episodes is None else episodes
        for index in range(len(raw) * group):
            prompt = index // group
            row = {"prompt": raw[prompt], **{name: column[prompt] for name, column in columns.items()}}
            environment = self.environment()
            row_number = int(numbers[prompt]) + 1 if numbers is not None else prompt + 1  # names the row in errors
            try:
                messages = checked_reset(environment, row, row_number)
            except BaseException:
                environment.close()
                raise
            schemas = [tool.schema for tool in environment.tools.values()]
            episodes.append(Episode(index, environment, opening_ids(self.tokenizer, messages, schemas), messages,
                                    row_number=row_number))
        return episodes

    def draw_turn(self, model: SharedBase, role: str | None, running: Sequence[Episode], group: int, turn: int,
                  seeds: list[int] | None, device: torch.device, as_given: bool = False) -> Drawn:
        """Turn ``turn`` of each running episode, each run of ``group`` consecutive episodes sharing its opening: on
        the first turn the episodes of a prompt open alike (their environments' ``reset`` saw the same row, unless
        it draws something), and their opening is encoded once for the group, as a single-turn rollout's."""
        pad_id = self.tokenizer.pad_token_id
        room = max(self.max_tokens - len(episode.tokens) for episode in running)
        max_new_tokens = min(self.sampler.settings.max_new_tokens, room)
        chosen = None if seeds is None else [seeds[e.index] for e in running]
        turn_seeds = chosen if as_given else Seeds.turn(chosen, turn)
        sequences = [episode.opening + episode.tokens for episode in running[::group]]
        input_ids, attention_mask = (t.to(device) for t in pad(sequences, pad_id, "left"))
        return self.sampler.draw(model, role, input_ids, attention_mask, group, turn_seeds, max_new_tokens)

    def take_turn(self, running: Sequence[Episode], drawn: Drawn, turn: int) -> None:
        """Append each running episode's sampled turn and its environment's answer."""
        for episode, tokens, keep, logprobs in zip(running, drawn.tokens, drawn.mask, drawn.logprobs, strict=True):
            room = self.max_tokens - len(episode.tokens)
            new = tokens[keep].tolist()[:room]
            episode.tokens += new
            episode.policy += [True] * len(new)
            episode.sampler_logprobs += logprobs[keep].tolist()[:room]
            episode.turns = turn
            self.answer(episode, new, turn)

    def answer(self, episode: Episode, new: list[int], turn: int) -> None:
        """The environment's answer to the turn just sampled (``new``), appended to ``episode``."""
        if not new or new[-1] not in self.sampler.settings.stop_token_ids:  # cut off mid-turn: nothing to answer
            episode.done = episode.truncated = True
            return
        text = self.tokenizer.decode(new[:-1], skip_special_tokens=False)
        parsed = self.tool_format.parse(text) if self.tool_format is not None else ParsedTurn(text.strip())
        episode.messages.append(assistant_message(parsed))
        step = checked_step(episode.environment, episode.messages, episode.row_number, turn)
        episode.rewards.append((len(episode.tokens) - 1, float(step.reward)))
        episode.counts.update(step.counts)
        if step.done or turn == self.max_turns:
            episode.done = True
            return
        answer = self.delta(step.messages)
        if len(episode.tokens) + len(answer) >= self.max_tokens:  # no room left for another turn
            episode.done = episode.truncated = True
            return
        episode.messages += step.messages
        episode.tokens += answer
        episode.policy += [False] * len(answer)
        episode.sampler_logprobs += [0.0] * len(answer)


def _openings_agree(episodes: Sequence[Episode], group: int) -> bool:
    """Whether each run of ``group`` consecutive episodes (one prompt's) opens with the same tokens."""
    return all(episode.opening == episodes[index - index % group].opening for index, episode in enumerate(episodes))
