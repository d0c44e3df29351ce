"""Best-of-n against the proxy reward model: sample from the SFT policy, keep the response the proxy likes
best, and measure what the gold reward thinks of it (the other half of Gao et al.'s figure).

The SFT policy is sampled once, ``N`` responses per prompt; every ``n <= N`` is then estimated from those same
samples with the unbiased estimator of the expected best-of-n (no resampling, no extra model calls).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.study.gao import best_of_n_kl


def best_of_n_weights(total: int, n: int) -> np.ndarray:
    """Probability that the ``i``-th smallest of ``total`` samples is the largest of a random ``n``-subset.

    The ``i``-th smallest (0-based) is the subset's maximum when it is drawn and the other ``n - 1`` come from
    the ``i`` below it: ``C(i, n - 1) / C(total, n)``. Weighting sorted samples by these gives an unbiased
    estimate of the expected best-of-n, with lower variance than drawing subsets.
    """
    if not 1 <= n <= total:
        raise ValueError(f"n must be in [1, {total}], got {n}")
    ranks = np.arange(total)
    # Logs of binomials: C(64, 32) is already near the float64 integer limit.
    log_choose = np.array([math.lgamma(i + 1) - math.lgamma(n) - math.lgamma(i - n + 2) if i >= n - 1
                           else -np.inf for i in ranks])
    log_total = math.lgamma(total + 1) - math.lgamma(n + 1) - math.lgamma(total - n + 1)
    return np.exp(log_choose - log_total)


def best_of_n_expectation(proxy: np.ndarray, gold: np.ndarray, n: int) -> tuple[float, float]:
    """Expected ``(gold, proxy)`` of the proxy's favourite among ``n`` samples, averaged over prompts.

    Args:
        proxy: ``[P, N]`` (or ``[N]``) proxy scores of ``N`` samples for each of ``P`` prompts.
        gold: the gold rewards of the same samples.
        n: samples per pick, ``1 <= n <= N``.
    """
    proxy, gold = np.atleast_2d(np.asarray(proxy, dtype=float)), np.atleast_2d(np.asarray(gold, dtype=float))
    if proxy.shape != gold.shape:
        raise ValueError(f"proxy and gold must have one shape, got {proxy.shape} and {gold.shape}")
    order = np.argsort(proxy, axis=1, kind="stable")
    weights = best_of_n_weights(proxy.shape[1], n)
    picked_gold = np.take_along_axis(gold, order, 1) @ weights
    picked_proxy = np.take_along_axis(proxy, order, 1) @ weights
    return float(picked_gold.mean()), float(picked_proxy.mean())


@dataclass(frozen=True)
class BestOfNPoint:
    """Best-of-n at one ``n``: its KL bound, and the expected gold and proxy reward of the pick."""

    n: int
    kl: float
    gold: float
    proxy: float

    @property
    def d(self) -> float:
        return math.sqrt(self.kl)


def best_of_n_curve(proxy: np.ndarray, gold: np.ndarray, ns: Sequence[int]) -> list[BestOfNPoint]:
    """:func:`best_of_n_expectation` at every ``n`` in ``ns``, with ``kl = log n - (n - 1) / n``."""
    points = []
    for n in ns:
        expected_gold, expected_proxy = best_of_n_expectation(proxy, gold, n)
        points.append(BestOfNPoint(n, float(best_of_n_kl(n)), expected_gold, expected_proxy))
    return points


@torch.no_grad()
def sample_reference(module: Any, batches: Iterable[dict[str, Any]], samples_per_prompt: int,
                     max_sequences: int = 2048, seed: int = 0, per_source: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``samples_per_prompt`` responses per prompt from the SFT policy, scored by the proxy and the gold
    reward.

    ``module`` is a :class:`rlhf_lightning.PPO`: its base with adapters disabled is the SFT policy, and its
    own generation settings, stop-token handling and scoring are used, so that the samples are exactly what a
    PPO run starts from and the proxy scores what PPO's ``ppo/objective/score`` reports.

    Args:
        module: the PPO module (with ``gold_reward`` set).
        batches: prompt batches as the prompt data module's validation loader yields them.
        samples_per_prompt: ``N``, the largest n of the curve.
        max_sequences: sequences generated at once (memory).
        seed: sampling seed.
        per_source: keep each reward source's score apart (``proxy`` ``[prompts, samples_per_prompt, sources]``)
            instead of their combination (e.g. the members of an ensemble, each an ensemble of one).

    Returns:
        ``(proxy, gold)``, each ``[prompts, samples_per_prompt]``.
    """
    policy = module.policy
    if policy.gold_reward is None:
        raise ValueError("best-of-n needs the task's gold reward (model.init_args.gold_reward)")
    module.configure_model()  # outside a Trainer: build it here (nothing happens once built)
    torch.manual_seed(seed)
    was_training = module.model.training
    module.model.eval()
    proxy, gold = [], []
    prompts_at_once = max(1, max_sequences // samples_per_prompt)
    for batch in batches:
        for start in range(0, batch["input_ids"].shape[0], prompts_at_once):
            rows = slice(start, start + prompts_at_once)
            ids, mask = batch["input_ids"][rows].to(module.device), batch["attention_mask"][rows].to(module.device)
            prompts = [p for p in batch["prompt"][rows] for _ in range(samples_per_prompt)]
            sequences, attention_mask, response_mask = policy.generate(ids, mask, role=REFERENCE,
                                                                       group=samples_per_prompt)
            texts = policy.decode(sequences[:, ids.shape[1]:], response_mask)
            scores = module.rewards.score(module.collector.reward_inputs(module, sequences, attention_mask, response_mask, texts, prompts))
            scores = scores if per_source else module.rewards.combine(scores)
            proxy.append(scores.reshape(-1, samples_per_prompt, *scores.shape[1:]).cpu().numpy())
            golds = np.asarray(policy.gold_reward(prompts, texts), dtype=float)
            gold.append(golds.reshape(-1, samples_per_prompt))
    module.model.train(was_training)
    return np.concatenate(proxy), np.concatenate(gold)


def powers_of_two(limit: int) -> list[int]:
    """``1, 2, 4, ...`` up to ``limit``, with ``limit`` itself last when it is not a power of two."""
    ns = [2**k for k in range(int(math.log2(limit)) + 1)]
    return ns if ns[-1] == limit else [*ns, limit]
