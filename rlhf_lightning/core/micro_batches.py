"""How a minibatch is split into micro-batches by a token budget (``micro_batch_tokens``): plain lists in, lists of
positions out, no model and no tensors, so every rule is checked number by number.

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

from collections.abc import Sequence

Extent = tuple[int, int]  # (opening columns, response columns) a row needs


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
