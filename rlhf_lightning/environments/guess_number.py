"""Guess the number: a small multi-turn game written with OpenEnv's classes, the example of OpenEnv environments as
episodes (``OpenEnvEnvironment``).

The environment hides a number from ``low`` to ``high`` (1 to 20), drawn from the seed it is reset with, and
answers each guess with ``higher``, ``lower`` or ``correct`` (reward 1, the episode ends). Halving the interval
finds any of the 20 numbers in five guesses; an episode of the shipped configs has five turns. An episode, in the
calculator task's ChatML-style template (this task reuses its tokenizer: a token per digit and letter)::

    <|im_start|>user guess my number, 1 to 20<|im_end|>
    <|im_start|>assistant 10<|im_end|>
    <|im_start|>user higher<|im_end|>
    <|im_start|>assistant 15<|im_end|>          (correct: reward 1, the episode ends)

The supervised demonstrations are games played against the environment itself by a careless player: at each turn
it guesses the middle of what the answers so far leave (30 %), any number they leave (40 %), or any number at all
(30 %), for five turns at most; it finds the number in about 61 % of games, where halving always does. The prompt
rows carry each game's seed (column ``seed``, also written in the prompt as ``game <seed>``, which the model never
reads: the environment writes the opening), so :func:`solved` can replay the game from the row alone.

Needs the optional ``openenv`` package (``pip install -e '.[openenv]'``); importing this module without it stops
with one line saying so.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.environments.openenv_support import require_openenv
from rlhf_lightning.tasks.calculator import build_tokenizer

require_openenv("rlhf_lightning.environments.guess_number")

from openenv.core.env_server.interfaces import Environment as OpenEnvBase  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

__all__ = ["GuessAction", "GuessNumberEnvironment", "GuessNumberTask", "GuessObservation", "GuessState",
           "build_tokenizer", "secret_of", "solved"]

LOW, HIGH = 1, 20
_GAME = re.compile(r"game (\d+)")
_LAST_NUMBER = re.compile(r"(\d+)\s*$")


def secret_of(seed: int, low: int = LOW, high: int = HIGH) -> int:
    """The number a game reset with ``seed`` hides: a function of the seed alone, so a row's seed replays it."""
    return random.Random(f"guess_number:{seed}").randint(low, high)


def opening_text(low: int = LOW, high: int = HIGH) -> str:
    return f"guess my number, {low} to {high}"


class GuessAction(Action):
    """One guess."""

    guess: int = Field(description="the number guessed")


class GuessObservation(Observation):
    """What the player reads: the opening, then ``higher``, ``lower``, ``correct`` or ``out of range``."""

    message: str = Field(description="the environment's answer")


class GuessState(State):
    """The hidden number and the interval the game is played on."""

    secret: int = 0
    low: int = LOW
    high: int = HIGH


class GuessNumberEnvironment(OpenEnvBase[GuessAction, GuessObservation, GuessState]):
    """Guess the number, as an OpenEnv environment: ``reset(seed)`` hides a number drawn from the seed, ``step``
    answers a :class:`GuessAction`; reward 1 when the guess is the number (the episode ends), else 0.

    Args:
        low: the smallest number it may hide.
        high: the largest.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # no state outside the instance: a server may hold many sessions

    def __init__(self, low: int = LOW, high: int = HIGH) -> None:
        super().__init__()
        if low > high:
            raise ValueError(f"GuessNumberEnvironment: low={low} is above high={high}")
        self._state = GuessState(low=low, high=high)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        low, high = self._state.low, self._state.high
        seed = random.randrange(2**31) if seed is None else seed
        self._state = GuessState(episode_id=episode_id, secret=secret_of(seed, low, high), low=low, high=high)
        return GuessObservation(message=opening_text(low, high))

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        state = self._state
        state.step_count += 1
        if action.guess == state.secret:
            return GuessObservation(message="correct", reward=1.0, done=True)
        if not state.low <= action.guess <= state.high:
            return GuessObservation(message="out of range", reward=0.0)
        return GuessObservation(message="higher" if action.guess < state.secret else "lower", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


def solved(prompts: Sequence[Any], completions: Sequence[str], seed: Sequence[int] | None = None,
           **_: object) -> list[float]:
    """1.0 where an episode's last guess is the hidden number (the game ended there), else 0.0 (TRL's
    reward-function signature). The game is replayed from the row's ``seed`` column, else from ``game <seed>`` in
    the prompt (a gold reward reads prompts and transcripts only)."""
    scores = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if seed is not None:
            game = int(seed[index])
        else:
            found = _GAME.search(prompt if isinstance(prompt, str) else str(prompt))
            if found is None:
                raise ValueError(f"solved: prompt {index + 1} names no game ('game <seed>'), and there is no seed "
                                 f"column: {prompt!r}")
            game = int(found.group(1))
        last = _LAST_NUMBER.search(completion.strip())
        scores.append(float(last is not None and int(last.group(1)) == secret_of(game)))
    return scores


@dataclass(frozen=True)
class GuessNumberTask:
    """The task's rows, deterministic from ``seed`` (``dataset: guess_number`` in a data module).

    Args:
        seed: seed of every row generated.
        turns: guesses per demonstration at most.
        middle_rate: share of the demonstrations' guesses that halve what the answers leave.
        inside_rate: share that pick any number the answers leave; the rest pick any number at all.
    """

    seed: int = 0
    turns: int = 5
    middle_rate: float = 0.3
    inside_rate: float = 0.4

    def _rng(self, stream: str) -> random.Random:
        return random.Random(f"guess_number:{self.seed}:{stream}")

    def guess(self, low: int, high: int, rng: random.Random) -> int:
        """The careless player's next guess, knowing the number is in [low, high]."""
        draw = rng.random()
        if draw < self.middle_rate:
            return (low + high) // 2
        if draw < self.middle_rate + self.inside_rate:
            return rng.randint(low, high)
        return rng.randint(LOW, HIGH)

    def demonstration(self, game: int, rng: random.Random) -> list[dict]:
        """One game played against :class:`GuessNumberEnvironment` reset with seed ``game``, as the messages after
        the opening (the last one the player's)."""
        environment = GuessNumberEnvironment()
        environment.reset(seed=game)
        low, high, messages = LOW, HIGH, []
        for _ in range(self.turns):
            guess = self.guess(low, high, rng)
            messages.append({"role": "assistant", "content": str(guess)})
            answer = environment.step(GuessAction(guess=guess))
            if answer.done:
                break
            messages.append({"role": "user", "content": answer.message})
            low, high = (max(low, guess + 1), high) if answer.message == "higher" else (
                (low, min(high, guess - 1)) if answer.message == "lower" else (low, high))
        if messages[-1]["role"] == "user":  # five wrong guesses: the demonstration ends on the last one
            messages.pop()
        return messages

    def _games(self, stream: str, n: int) -> list[int]:
        rng = self._rng(stream)
        return [rng.randrange(2**31) for _ in range(n)]

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` demonstrations in TRL's conversational prompt-completion form."""
        rng = self._rng("sft-player")
        return [{"prompt": [{"role": "user", "content": opening_text()}],
                 "completion": self.demonstration(game, rng)} for game in self._games("sft", n)]

    def prompt_rows(self, n: int) -> list[dict]:
        """``n`` games for RL: the prompt names the game, ``seed`` is what the environment is reset with."""
        return [{"prompt": f"{opening_text()} (game {game})", "seed": game} for game in self._games("prompts", n)]

    def preference_rows(self, n: int) -> list[dict]:
        raise ValueError("dataset: guess_number has no preference rows (it is an environment's task: SFT on "
                         "demonstrations, then an online algorithm with the environment)")
