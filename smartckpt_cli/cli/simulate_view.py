"""Rich rendering of a SimResult: a table that fits the terminal (or the log) it is printed to.

At 80 columns a ten-column table cuts every header to four letters, so below ``WIDE`` columns
the table keeps only numbers, with their units in the headers (two lines each), and each
policy's calibrated setting goes on a line of its own above it; onset columns appear only when
there are onsets. From ``WIDE`` columns on, the full table. ``--json`` always has everything.
"""

from __future__ import annotations

from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table

from smartckpt_cli.simulate import PolicyResult, SimResult

__all__ = ["WIDE", "render"]

WIDE = 120  # columns from which the full table is shown


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _count(checkpoints: int, exact: bool) -> str:
    return str(checkpoints) if exact else f"{checkpoints}*"


def render(result: SimResult, console: Console) -> None:
    cfg = result.config
    console.print(
        f"policies at MTBF {cfg.mtbf:g} s, save cost {cfg.save_cost:g} s, commit after {cfg.save_total:g} s",
        highlight=False,
    )
    wide = console.width >= WIDE
    onsets = bool(result.onsets)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    if not wide:  # each policy's setting on a line of its own, above the table
        width = max(len(p.name) for p in result.policies)
        for p in result.policies:
            console.print(f"  {p.name:<{width}}  {p.knob}", highlight=False, soft_wrap=True)
    for name, justify in _head(wide, onsets):
        table.add_column(name, justify=justify, no_wrap=True)
    for p in result.policies:
        table.add_row(*_row(p, wide, onsets))
    console.print(table)
    if any(not p.exact_count for p in result.policies):
        console.print(
            f"* calibration could not reach exactly {result.target} checkpoints: the nearest count is shown",
            highlight=False,
        )


def _head(wide: bool, onsets: bool) -> list[tuple[str, JustifyMethod]]:
    """The columns: all of them when ``wide``; else numbers only, onset columns with onsets."""
    if wide:
        return [
            ("policy", "left"),
            ("setting", "left"),
            ("checkpoints", "right"),
            ("overhead\n%", "right"),
            ("lost per\nfailure s", "right"),
            ("expected\nlost s", "right"),
            ("onset dist\nmean s", "right"),
            ("onset dist\nmax s", "right"),
            ("rollback\nlost s", "right"),
            ("missed\nonsets", "right"),
        ]
    head: list[tuple[str, JustifyMethod]] = [
        ("policy", "left"),
        ("saves", "right"),
        ("overhead\n%", "right"),
        ("lost per\nfailure s", "right"),
        ("expected\nlost s", "right"),
    ]
    if onsets:
        head += [("onset dist\nmean/max s", "right"), ("rollback\nlost s", "right"), ("missed", "right")]
    return head


def _row(p: PolicyResult, wide: bool, onsets: bool) -> list[str]:
    """One policy's cells, for the columns :func:`_head` gives."""
    count = _count(p.checkpoints, p.exact_count)
    row = [p.name]
    if wide:
        row += [p.knob, count]
    else:
        row.append(count)
    row += [f"{p.overhead * 100:.2f}", _sec(p.mean_lost), _sec(p.expected_lost)]
    if wide:
        row += [
            _sec(p.mean_distance),
            _sec(p.max_distance),
            _sec(p.mean_rollback_lost),
            str(p.missed) if onsets else "-",
        ]
    elif onsets:
        row += [
            f"{_sec(p.mean_distance)}/{_sec(p.max_distance)}",
            _sec(p.mean_rollback_lost),
            str(p.missed),
        ]
    return row
