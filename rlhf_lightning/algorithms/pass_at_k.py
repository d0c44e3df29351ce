"""pass@k and maj@k of ``n`` sampled responses per prompt, as reasoning papers report them.

pass@k is the probability that at least one of ``k`` responses drawn from the ``n`` is correct, estimated without
bias from the count ``c`` of correct ones (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
eq. 1: ``1 - C(n-c, k) / C(n, k)``), computed as a product so that no binomial coefficient overflows. maj@k is the
accuracy of the answer most of ``k`` responses give (self-consistency, Wang et al. 2022): the ``n`` responses are
cut into ``n // k`` consecutive blocks of ``k`` (independent draws, so each block is a fair sample) and the blocks'
accuracies averaged; a tie between answers counts the share of the tied answers that are right (the expectation of
breaking the tie at random), and responses without an answer do not vote.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def pass_at_k(correct: Tensor, k: int) -> Tensor:
    """``[P]`` unbiased pass@k of ``correct`` ``[P, n]`` (bool: response ``j`` to prompt ``i`` is right), ``k <= n``."""
    n = correct.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n, the responses per prompt (n = {n})")
    c = correct.sum(-1, dtype=torch.float64)
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i); it is 1 once fewer than k responses are wrong (n - c < k).
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)
    counted = i[None, :] > (n - c)[:, None]
    miss = torch.where(counted, 1 - k / i, 1.0).prod(-1)
    return torch.where(n - c < k, 1.0, 1 - miss).float()


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """Accuracy of the majority answer among ``answers`` (None: no answer, no vote), each answer right or wrong as
    ``correct`` says of its responses; ties count the share of the tied answers that are right; 0 without votes."""
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [answer for answer, count in votes.items() if count == top]
    right = {answer for answer, ok in zip(answers, correct, strict=True) if answer is not None and ok}
    return sum(answer in right for answer in tied) / len(tied)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct: Tensor, k: int) -> Tensor:
    """``[P]`` maj@k: per prompt, the mean over ``n // k`` consecutive blocks of ``k`` of its ``n`` responses
    (``answers`` ``P x n``, ``correct`` ``[P, n]``) of the majority answer's accuracy (:func:`majority_correct`)."""
    n = correct.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs 1 <= k <= n, the responses per prompt (n = {n})")
    flags = correct.tolist()
    return torch.tensor([
        sum(majority_correct(row[start:start + k], ok[start:start + k]) for start in range(0, n - k + 1, k))
        / (n // k)
        for row, ok in zip(answers, flags, strict=True)])
