"""How a rollout is split into minibatches, and a minibatch into micro-batches (equal parts, or by a token budget,
``micro_batch_tokens``), as the ``update`` group (:class:`UpdateSettings`) says: plain lists in, lists of positions
out, no model and no tensors, so every rule is checked number by number.

A row's cost is the columns it needs, ``(opening, response)``: its prompt's real tokens (prompts are left-padded)
and its response's (right-padded). A micro-batch is cut to its own longest opening plus its own longest response,
so its padded size is ``rows x (longest opening + longest response)``. Rows are taken as units of ``unit``
consecutive rows that are never split (online DPO's pairs), longest first, and packed greedily while the padded
size stays within the budget; a unit over the budget on its own is a micro-batch of its own.

Under DDP and FSDP2 every rank must run as many backward passes as the others (each one is a collective), so
:func:`split_to_count` splits a rank's largest micro-batches until it has the most any rank has. Splitting never
changes a gradient: the loss is normalised over the whole optimizer step, whatever its micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf_lightning.utils import checks

Extent = tuple[int, int]  # (opening columns, response columns) a row needs


@dataclass(frozen=True)
class UpdateSettings:
    """The ``update`` argument of every online module: how the policy trains on each rollout -- its passes,
    minibatches and micro-batches, the early stop on KL and gradient clipping. A config sets some fields and keeps
    the module's defaults for the others (``update: {epochs: 2, num_minibatches: 2}``).

    Args:
        epochs: passes over each rollout batch.
        num_minibatches: minibatches, hence optimizer steps, per pass.
        gradient_accumulation: micro-batches per minibatch (less memory; same result).
        micro_batch_tokens: instead of ``gradient_accumulation`` equal micro-batches, pack each minibatch's rows,
            longest first, into micro-batches of at most this many tokens, padding included (a longer row alone);
            same result; null = off.
        target_kl: stop an iteration's epochs once a minibatch's approximate KL to the sampling policy exceeds
            this; null = never.
        max_grad_norm: clip the gradient norm to this; null = off.
    """

    epochs: int = 1
    num_minibatches: int = 1
    gradient_accumulation: int = 1
    micro_batch_tokens: int | None = None
    target_kl: float | None = None
    max_grad_norm: float | None = 1.0

    def check(self, name: str = "update") -> UpdateSettings:
        """Raise a one-line error naming ``name.field``: at least 1 of each split, micro-batches by tokens or into
        equal parts (not both), positive bounds."""
        for field in ("epochs", "num_minibatches", "gradient_accumulation"):
            checks.at_least(f"{name}.{field}", getattr(self, field))
        checks.at_least(f"{name}.micro_batch_tokens", self.micro_batch_tokens, optional=True)
        if self.micro_batch_tokens is not None and self.gradient_accumulation != 1:
            raise ValueError(f"{name}.micro_batch_tokens={self.micro_batch_tokens} and {name}.gradient_accumulation="
                             f"{self.gradient_accumulation} both split each minibatch into micro-batches: by tokens, "
                             f"or into equal parts; set {name}.gradient_accumulation: 1 or {name}.micro_batch_tokens: "
                             "null")
        checks.positive(f"{name}.target_kl", self.target_kl, optional=True)
        checks.positive(f"{name}.max_grad_norm", self.max_grad_norm, optional=True)
        return self

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps made on one rollout (before any target-KL stop)."""
        return self.epochs * self.num_minibatches

    @property
    def whole_first_step(self) -> bool:
        """The first optimizer step is one micro-batch of the whole rollout."""
        return self.num_minibatches == 1 and self.gradient_accumulation == 1 and self.micro_batch_tokens is None


def padded_size(extents: Sequence[Extent]) -> int:
    """Tokens of a micro-batch of rows of these ``extents`` once cut to its own rows: rows x (longest opening +
    longest response)."""
    if not extents:
        return 0
    return len(extents) * (max(opening for opening, _ in extents) + max(response for _, response in extents))


def units_of(extents: Sequence[Extent], unit: int) -> list[list[int]]:
    """The positions ``0 .. len(extents) - 1`` as consecutive units of ``unit`` rows."""
    if len(extents) % unit:
        raise ValueError(f"{len(extents)} rows do not split into units of {unit} consecutive rows")
    return [list(range(start, start + unit)) for start in range(0, len(extents), unit)]


def pack_by_tokens(extents: Sequence[Extent], budget: int, unit: int = 1) -> list[list[int]]:
    """Positions of the rows of each micro-batch: units of ``unit`` consecutive rows, longest first (opening plus
    response, ties in their order), added to the current micro-batch while its :func:`padded_size` stays within
    ``budget``; a unit that does not fit starts the next one."""
    # units of equal row counts: the longest have the largest padded size
    units = sorted(units_of(extents, unit), key=lambda rows: -padded_size([extents[r] for r in rows]))
    micros: list[list[int]] = []
    for rows in units:
        if micros and padded_size([extents[r] for r in micros[-1] + rows]) <= budget:
            micros[-1] += rows
        else:
            micros.append(list(rows))
    return micros


def split_to_count(micros: Sequence[list[int]], extents: Sequence[Extent], count: int,
                   unit: int = 1) -> list[list[int]]:
    """``micros`` made ``count`` micro-batches by halving, again and again, the one of the largest padded size that
    holds more than one unit (its first half keeps the extra unit). ``count`` may be at most the number of units."""
    micros = [list(rows) for rows in micros]
    if count > len(extents) // unit:
        raise ValueError(f"{len(extents)} rows in units of {unit} cannot make {count} micro-batches")
    while len(micros) < count:
        splittable = [index for index, rows in enumerate(micros) if len(rows) > unit]
        index = max(splittable, key=lambda i: padded_size([extents[r] for r in micros[i]]))
        rows = micros[index]
        half = (len(rows) // unit + 1) // 2 * unit
        micros[index: index + 1] = [rows[:half], rows[half:]]
    return micros


def minibatch_sizes(batch_size: int, num_minibatches: int, gradient_accumulation: int, unit: int = 1,
                    origin: str | None = None) -> tuple[int, int]:
    """``(minibatch size, micro-batch size)`` of a rollout of ``batch_size`` rows split into ``num_minibatches``
    minibatches of ``gradient_accumulation`` equal micro-batches of whole units of ``unit`` rows (``origin``: where
    ``batch_size`` comes from, for the message)."""
    if (batch_size % num_minibatches or (batch_size // num_minibatches) % gradient_accumulation
            or (batch_size // num_minibatches // gradient_accumulation) % unit):
        raise ValueError(
            f"the rollout batch of {batch_size} responses{f' ({origin})' if origin else ''} must split into "
            f"update.num_minibatches={num_minibatches} "
            f"minibatches of update.gradient_accumulation={gradient_accumulation} equal micro-batches"
            f"{f' of whole groups of {unit} rows' if unit > 1 else ''}; "
            "change data.init_args.batch_size, samples_per_prompt or these two"
        )
    minibatch_size = batch_size // num_minibatches
    return minibatch_size, minibatch_size // gradient_accumulation


def micro_batch_parts(extents: Sequence[Extent], gradient_accumulation: int, budget: int | None, unit: int = 1,
                      most_over_ranks: Callable[[int], int] = lambda count: count) -> list[list[int]]:
    """Positions of the rows of each micro-batch of a minibatch whose rows need ``extents``: ``gradient_accumulation``
    equal consecutive parts, or packed by the token ``budget`` (:func:`pack_by_tokens`) and split to as many as any
    rank has (``most_over_ranks`` of this rank's count; :func:`split_to_count`)."""
    if budget is None:
        size = len(extents) // gradient_accumulation
        return [list(range(start, start + size)) for start in range(0, len(extents), size)]
    parts = pack_by_tokens(extents, budget, unit)
    return split_to_count(parts, extents, most_over_ranks(len(parts)), unit)
