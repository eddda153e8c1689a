"""Sequence packing: several short examples per row of ``max_seq_len`` tokens.

Examples are taken in windows of ``ceil(packing_ratio * device_batch_size)`` (in the loader's
seeded order) and each window is packed by first-fit-decreasing on token lengths: the longest
example first, each into the first row with room, else into a new row. Every example of
the window lands in some row, so no token is dropped; a window just gives as many rows as it
needs. Within a row the examples keep their window order and get ``sequence_id`` 0, 1, ...
so they never attend to each other (the model masks attention across ids and restarts
positions at each new id).

``packing_ratio: auto`` is chosen from the length statistics alone, without trial packing:
``max_seq_len / mean length``, rounded down to a tenth and at least 1; the window then holds
about as many tokens as ``device_batch_size`` full rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total length <= ``capacity``.

    Each bin lists its indices in increasing order; bins are in the order they were opened.
    An item longer than ``capacity`` raises ValueError.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return [sorted(b) for b in bins]


def auto_packing_ratio(lengths: Sequence[int], max_seq_len: int) -> tuple[float, str]:
    """The packing ratio for ``lengths`` and one line saying why."""
    mean = sum(lengths) / len(lengths)
    ratio = max(1.0, math.floor(10 * max_seq_len / mean) / 10)
    why = (f"examples average {mean:.1f} tokens (longest {max(lengths)}) in rows of "
           f"{max_seq_len}: about {max_seq_len / mean:.2f} fit in a row")
    return ratio, why


def pack(lengths: Sequence[int], capacity: int, window: int) -> list[list[int]]:
    """Rows of example indices: first-fit-decreasing within consecutive windows."""
    rows = []
    for start in range(0, len(lengths), window):
        chunk = lengths[start:start + window]
        rows += [[start + i for i in b] for b in first_fit_decreasing(chunk, capacity)]
    return rows
