"""Which columns of a wide table fit the terminal: the pure half of ``inspect``'s tables.

Rich squeezes every column of a table that is too wide until each reads ``36…``: at 80
columns a step number, the one cell a user came for, was cut. Instead a table keeps whole
cells and leaves out whole columns, the least needed first, and says which ones it left out
(``--json`` and a wider terminal show them all). A column may fold instead (a tensor's name
wraps inside its cell, since no other column says which tensor a row is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A rich table with the default box: one rule at the left, then per column its cell, one space
# of padding each side and the rule after it.
_EDGE = 1
_PER_COLUMN = 3
# The narrowest a folding column is drawn while other columns still fit beside it.
FOLD_MIN = 24


@dataclass(frozen=True)
class Column:
    header: str
    justify: str = "left"
    drop: int = 0  # 0: always shown; otherwise the higher, the sooner it is left out
    fold: bool = False  # wraps inside its cell rather than widen the table


@dataclass(frozen=True)
class Fit:
    shown: list[int]  # indices into the columns, in their order
    left_out: list[str]  # the headers of the others, in their order

    def note(self, width: int) -> str | None:
        if not self.left_out:
            return None
        return f"left out at {width} columns: {', '.join(self.left_out)} (--json has every column)"


def cell_width(text: str) -> int:
    return max((len(line) for line in text.split("\n")), default=0)


def natural_width(columns: Sequence[Column], rows: Sequence[Sequence[str]], index: int) -> int:
    """The width column ``index`` needs to show its header and every cell whole."""
    return max([len(columns[index].header), *(cell_width(r[index]) for r in rows)])


def table_width(columns: Sequence[Column], rows: Sequence[Sequence[str]], shown: Sequence[int]) -> int:
    return _EDGE + sum(
        (
            min(natural_width(columns, rows, i), FOLD_MIN)
            if columns[i].fold
            else natural_width(columns, rows, i)
        )
        + _PER_COLUMN
        for i in shown
    )


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> Fit:
    """Leave out columns, the highest ``drop`` first (the rightmost among equals), until the
    table with whole cells fits ``width``; columns with ``drop == 0`` always stay (they may
    still not fit: then the terminal wraps them, which cuts nothing)."""
    shown = list(range(len(columns)))
    while table_width(columns, rows, shown) > width:
        droppable = [i for i in shown if columns[i].drop > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    return Fit(shown, [c.header for i, c in enumerate(columns) if i not in shown])
