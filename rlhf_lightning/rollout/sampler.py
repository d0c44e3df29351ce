"""The sampler: one object that owns how tokens are drawn.

It holds the sampling settings, the random streams (:class:`~rlhf_lightning.rollout.seeds.Seeds`), the engine (the
modules' ``engine``, resolved for the device at the first draw and kept with its caches and compiled steps) and the
gathering of an FSDP2-sharded base. Callers enter :meth:`Sampler.gathered_base` once per rollout (sampling and
every scoring pass run inside it; DPO's precomputed reference, which samples nothing, enters it too) and call
:meth:`Sampler.draw` for each turn.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlhf_lightning.models.sharding import gathered
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Auto, Engine
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings, truncate_after_stop
from rlhf_lightning.utils.timing import phase

ShardedRollout = Literal["gathered", "per_layer"]


@dataclass(frozen=True)
class Drawn:
    """Responses drawn for prompts: each prompt's row repeated for its ``group`` responses (consecutive rows)."""

    prompt_ids: Tensor  # [N, P] left-padded prompts, one row per response
    prompt_mask: Tensor  # [N, P]
    tokens: Tensor  # [N, R] response tokens, pad after each row's stop token
    mask: Tensor  # [N, R] bool: each response's tokens, its stop token included
    logprobs: Tensor  # [N, R] the log-probs the sampler drew them with (0 after the stop)

    @property
    def sequences(self) -> Tensor:
        """``[N, P + R]`` prompts and responses."""
        return torch.cat([self.prompt_ids, self.tokens], 1)

    @property
    def attention_mask(self) -> Tensor:
        """``[N, P + R]`` 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.mask.long()], 1)


class Sampler:
    """Draws responses from a role of the shared base.

    Args:
        settings: how tokens are sampled.
        seeds: the random streams.
        pad_token_id: what fills a response after its stop token.
        sharded_rollout: how an FSDP2-sharded base is gathered during a rollout (the modules' argument).
        engine: what draws the tokens (the modules' argument); :class:`~rlhf_lightning.rollout.engines.Auto` by
            default.
    """

    def __init__(self, settings: SamplingSettings, seeds: Seeds, pad_token_id: int,
                 sharded_rollout: ShardedRollout = "gathered", engine: Engine | None = None) -> None:
        self.settings = settings
        self.seeds = seeds
        self.pad_token_id = pad_token_id
        self.sharded_rollout = sharded_rollout
        self.chosen = Auto() if engine is None else engine
        self._engines: dict[tuple[str, bool], Engine] = {}

    def engine(self, model: SharedBase) -> Engine:
        """The engine that draws from ``model``: the chosen one, resolved for its device and sharding at first use,
        then kept (its caches and compiled steps serve every rollout)."""
        place = (str(next(model.parameters()).device), model.is_sharded)
        if place not in self._engines:
            self._engines[place] = self.chosen.resolved(torch.device(place[0]), place[1], self.settings.kv_cache)
        return self._engines[place]

    def sync(self, model: SharedBase, role: str, version: int) -> None:
        """After an optimizer step changed ``role``'s adapter (now its ``version``): every engine brings its copy of
        the weights up to date (:meth:`~rlhf_lightning.rollout.engines.Engine.sync`)."""
        for engine in self._engines.values():
            engine.sync(model, role, version)

    def sync_roles(self, model: SharedBase, roles: Sequence[str], version: int) -> float:
        """:meth:`sync` of each of ``roles`` (the training loop's, after every optimizer step); the seconds it took
        (logged as ``time/engine_sync``)."""
        start = time.perf_counter()
        with phase("update/engine sync"):
            for role in roles:
                self.sync(model, role, version)
        return time.perf_counter() - start

    @contextmanager
    def gathered_base(self, model: SharedBase) -> Iterator[None]:
        """A block of no-grad passes over ``model`` with its sharded base gathered as ``sharded_rollout`` says
        (every layer for the whole block, or each layer per forward pass); nothing without sharding. Entered once
        per rollout (sampling and scoring) and by DPO's precomputed reference; at its end the engines rest (vLLM's
        sleep on a GPU)."""
        try:
            with gathered(model, whole=self.sharded_rollout == "gathered"):
                yield
        finally:
            for engine in self._engines.values():
                engine.rest()

    def close(self) -> None:
        """Release the engines (vLLM's copy of the weights and its KV cache); the next draw makes them anew."""
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()

    @torch.no_grad()
    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int = 1,
             seeds: Sequence[int] | None = None, max_new_tokens: int | None = None) -> Drawn:
        """``group`` responses to each left-padded prompt ``[B, P]`` from ``role``, cut after their stop token.

        ``seeds``: one per response (see :meth:`Seeds.rows`); None = the global random stream.
        ``max_new_tokens``: fewer than the settings' (an episode's last turns); None = the settings'.
        """
        settings = self.settings
        if max_new_tokens is not None and max_new_tokens != settings.max_new_tokens:
            settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
        synced = model.is_sharded and self.sharded_rollout == "per_layer"
        tokens, logprobs = self.engine(model).draw(model, role, input_ids, attention_mask, group, settings,
                                                   self.pad_token_id, seeds, synced)
        tokens, mask = truncate_after_stop(tokens, settings.stop_token_ids, self.pad_token_id)
        return Drawn(input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0), tokens, mask,
                     torch.where(mask, logprobs.to(tokens.device), 0.0))
