"""How a rollout is split into minibatches, and a minibatch into micro-batches (equal parts, or by a token budget,
``micro_batch_tokens``): plain lists in, lists of positions out, no model and no tensors, so every rule is checked
number by number.

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

from rlhf_lightning.utils import checks

Extent = tuple[int, int]  # (opening columns, response columns) a row needs


def check_split(epochs: int, num_minibatches: int, gradient_accumulation: int, micro_batch_tokens: int | None) -> None:
    """The update's passes and how each splits the rollout: at least 1 of each; micro-batches by tokens or into
    equal parts, not both."""
    for name, value in {"epochs": epochs, "num_minibatches": num_minibatches,
                        "gradient_accumulation": gradient_accumulation}.items():
        checks.at_least(name, value)
    checks.at_least("micro_batch_tokens", micro_batch_tokens, optional=True)
    if micro_batch_tokens is not None and gradient_accumulation != 1:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} and gradient_accumulation={gradient_accumulation} "
                         "both split each minibatch into micro-batches: by tokens, or into equal parts; set "
                         "gradient_accumulation: 1 or micro_batch_tokens: null")


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
            f"num_minibatches={num_minibatches} "
            f"minibatches of gradient_accumulation={gradient_accumulation} equal micro-batches"
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
