"""Multi-turn episodes in the on-policy loop: what :class:`~rlhf_lightning.core.online.OnlineRL` does when it
is given an ``environment``.

The loop itself does not change: an episode batch is laid out as a single-turn rollout is (opening left-padded,
episode right-padded) with ``response_mask`` marking the policy's tokens only, so the log-probs, the KL, the
entropy and every loss skip the tool and environment tokens by the mask they already use. The environment's
per-turn rewards are summed into the scores (group baselines compare whole episodes) and kept per token in
``Experience.turn_rewards`` (PPO's rewards place each at its turn's last token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.policy import POLICY, derive_seed
from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.episodes.environment import Environment
from rlhf_lightning.episodes.rollout import EpisodeBatch, TemplateDelta, run_episodes, transcript_text
from rlhf_lightning.episodes.tool_calls import detect_format
from rlhf_lightning.ops.sampling import row_draws


class EpisodeSampling:
    """Episode rollouts for a policy module (mixed into ``OnlineRL``). ``environment`` is called once per
    episode; ``max_turns`` and ``max_episode_tokens`` bound an episode."""

    environment: Callable[[], Environment] | None

    def setup_episodes(self) -> None:
        """Read the template's tool-call format and turn delimiters once, before any rollout: a template we
        cannot parse stops the run here, naming itself."""
        probe = self.environment()
        if not isinstance(probe, Environment):
            raise TypeError(f"environment: expected a factory of rlhf_lightning.episodes.Environment, got one of "
                            f"{type(probe).__name__}")
        self.tool_format = detect_format(self.tokenizer) if probe.tools else None
        self.template_delta = TemplateDelta(self.tokenizer, completion_end_id(self.tokenizer, conversational=True))

    def check_lengths(self, datamodule: Any) -> None:
        """With an environment, the longest prompt and a whole episode must fit the model's positions (the
        opening's chat template adds its markers on top)."""
        if self.environment is None:
            return super().check_lengths(datamodule)
        longest = datamodule.longest()
        self.check_positions(longest + self.episode_budget,
                             f"the longest prompt ({longest} tokens) and an episode of {self.episode_budget} tokens",
                             "lower max_episode_tokens (null = max_turns x max_new_tokens) or "
                             "data.init_args.max_length")

    @property
    def episode_budget(self) -> int:
        """Tokens an episode may hold after its opening."""
        hp = self.hparams
        return hp.max_episode_tokens or hp.max_turns * hp.max_new_tokens

    def sample_episodes(self, prompts: dict[str, Any], per_prompt: int, purpose: str) -> EpisodeBatch:
        """``per_prompt`` episodes per prompt of the batch (consecutive rows), each with an environment of its
        own; ``purpose`` names the random streams (``seed_scope: prompt``)."""
        raw = prompts.get("raw_prompt", prompts["prompt"])
        columns = prompts.get("columns", {})
        rows = [{"prompt": raw[i], **{name: column[i] for name, column in columns.items()}}
                for i in range(len(raw)) for _ in range(per_prompt)]
        numbers = prompts.get("index")
        row_numbers = ([int(n) + 1 for n in numbers.tolist() for _ in range(per_prompt)] if numbers is not None
                       else [i // per_prompt + 1 for i in range(len(rows))])
        seeds = self.row_seeds(purpose, numbers, per_prompt)

        def draws(turn: int, episodes: list[int]) -> Tensor | None:
            if seeds is None:
                return None
            return row_draws([derive_seed(seeds[i], "turn", turn) for i in episodes], self.hparams.max_new_tokens,
                             self.device)

        if self.model.is_sharded and self.hparams.sharded_rollout == "per_layer":
            raise ValueError("episodes need sharded_rollout: gathered (ranks finish their episodes at different "
                             "turns, so they cannot gather layers in step)")
        return run_episodes(self.model, POLICY, self.tokenizer, [self.environment() for _ in rows], rows,
                            row_numbers, self.sampling, self.hparams.max_turns, self.episode_budget,
                            self.tool_format, self.template_delta, draws)

    def transcripts(self, batch: EpisodeBatch) -> list[str]:
        """Each episode as text with its environment's parts in ``[[...]]`` (for tables of completions)."""
        return [transcript_text(self.tokenizer, episode) for episode in batch.episodes]

    @staticmethod
    def episode_mask(batch: EpisodeBatch) -> Tensor:
        """``[B, R]`` every token of each episode after its opening, the policy's and the environment's."""
        return batch.attention_mask[:, -batch.policy_mask.shape[1]:].bool()

    @torch.no_grad()
    def evaluate_episodes(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """One episode per held-out prompt (evaluation batch ``batch_idx``'s fixed seed, training's random stream
        untouched): the validation values of single-turn samples over the policy's tokens (``kl``, ``length``,
        ``eos_frac``), ``gold`` and ``score`` of the transcript, and the episode's ``turns``, ``tool_calls``,
        ``tool_errors`` and ``invalid_tool_calls``."""
        with self.validation_randomness(batch_idx), self.rollout_gathered():
            episodes = self.sample_episodes(batch, 1, "validation")
        ids, attention, read = episodes.input_ids, episodes.attention_mask, self.episode_mask(episodes)
        completions = self.decode(ids[:, ids.shape[1] - read.shape[1]:], read)
        values = self.sample_values(ids, attention, episodes.policy_mask, batch["prompt"], completions)
        values["turns"] = torch.tensor([float(e.turns) for e in episodes.episodes])
        for name in ("tool_calls", "tool_errors", "invalid_tool_calls"):
            values[name] = torch.tensor([float(e.counts[name]) for e in episodes.episodes])
        values.update(self.evaluate_extra(ids, attention, read, batch["prompt"], completions,
                                          batch.get("raw_prompt"), batch.get("columns")))
        self.record_validation(values)
        return values
