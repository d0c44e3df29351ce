"""Finding NaN and infinity before they are trained on or written: in reward scores, losses, gradients and weights.

A single non-finite reward turns every advantage of a whitened batch into NaN, one optimizer step turns the
adapters into NaN, and the checkpoint and the export then carry them silently. Each check here names where the
value came from (which reward source and rows, which loss term, which parameters), so that the run stops with
one line that says what to look at; ``optimizer.nonfinite: skip`` skips the optimizer step instead and counts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

NonFinite = Literal["raise", "skip"]
SKIP_HINT = "set optimizer.nonfinite: skip to skip such optimizer steps instead"


class NonFiniteError(FloatingPointError):
    """A NaN or infinity in reward scores, a loss, gradients or weights; the message says where."""


def listing(names: Sequence[Any], limit: int = 4) -> str:
    """``[a, b, c]``, or ``[a, b, c, d, ... (12 in all)]`` for long lists."""
    shown = ", ".join(str(name) for name in names[:limit])
    return f"[{shown}]" if len(names) <= limit else f"[{shown}, ... ({len(names)} in all)]"


def nonfinite_names(named: Iterable[tuple[str, Tensor | None]]) -> list[str]:
    """Names of the tensors that hold a NaN or an infinity (None entries are skipped)."""
    return [name for name, value in named
            if value is not None and value.is_floating_point() and not bool(torch.isfinite(value).all())]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor is finite, in a few fused kernels: the max-norm of each is NaN or inf exactly when it
    holds one (unlike the 2-norm, whose sum of squares overflows for large finite values)."""
    tensors = [t for t in tensors if t.numel()]  # a rank's shard of a small weight may be empty
    if not tensors:
        return True
    norms = torch._foreach_norm([t.detach().float() for t in tensors], ord=float("inf"))
    return bool(torch.isfinite(torch.stack(norms)).all())


def check_finite_weights(state: Mapping[str, Tensor], what: str) -> None:
    """Raise :class:`NonFiniteError` if ``state`` holds a non-finite weight: nothing is written with one."""
    bad = nonfinite_names(state.items())
    if bad:
        raise NonFiniteError(f"refusing to write {what}: non-finite values in {len(bad)} weights {listing(bad, 3)}")


# ---- reward scores ----------------------------------------------------------------------------------------

def source_label(source: Any) -> str:
    """A reward source as a user configured it: ``'reward_model' (AdapterReward outputs/reward/adapters/reward)``."""
    where = getattr(source, "path", None) or getattr(source, "name_or_path", None) or getattr(source, "url", None)
    kind = type(source).__name__
    return f"{source.name!r} ({kind}{f' {where}' if where else ''})"


def may_abstain(source: Any) -> bool:
    """Whether NaN from ``source`` means "not applicable to this response" (``RewardSource.score``'s convention):
    the source's own ``may_abstain`` (reward models score every response, so a NaN from them is a numerical
    failure; Python functions say "not applicable" with None, which ``FunctionReward`` turns into NaN)."""
    return bool(getattr(source, "may_abstain", True))


def score_problems(scores: Tensor, sources: Sequence[Any]) -> tuple[list[str], Tensor]:
    """What is wrong with the scores ``[B, S]`` of ``sources``: one line per source that returned an infinity, or
    a NaN where NaN cannot mean "not applicable", naming its rows; and the ``[B]`` mask of those rows."""
    problems, bad_rows = [], torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    for column, source in zip(scores.unbind(-1), sources, strict=True):
        bad = torch.isinf(column) if may_abstain(source) else ~torch.isfinite(column)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            values = sorted({str(float(column[row])) for row in rows})
            problems.append(f"reward source {source_label(source)} returned {'/'.join(values)} for rows "
                            f"{listing(rows)} of {column.shape[0]}")
            bad_rows |= bad
    return problems, bad_rows


def first_nonfinite_loss(step_losses: list[tuple[str, dict[str, Tensor]]]) -> str | None:
    """The first non-finite loss of an optimizer step's ``(where, {name: value})`` terms, as one line, or None."""
    for where, losses in step_losses:
        bad = {name: float(value.float().mean()) for name, value in losses.items()
               if not bool(torch.isfinite(value).all())}
        if bad:
            return f"{where}: non-finite loss {', '.join(f'{name}={value}' for name, value in bad.items())}"
    return None
