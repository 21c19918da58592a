"""What the journal commands share: the directory argument, consoles, sizes, the progress bar."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = [
    "DirArg",
    "MetaDirOpt",
    "RemoteOpt",
    "err",
    "fitted_table",
    "human",
    "open_checkpoints",
    "out",
    "progress_bar",
    "say",
]

# readable=False: an unreadable directory is reported by open_store in one line (exit 2), not by
# click's multi-line usage error.
DirArg = Annotated[
    Path, typer.Argument(help="Checkpoint store directory.", show_default=False, readable=False)
]

# verify, inspect and prune read a store in a directory or at a URL (a replica: s3://, file://).
StoreArg = Annotated[
    str,
    typer.Argument(
        help="Checkpoint store: a directory, or the URL of a replica (s3://bucket/prefix, file:///path).",
        show_default=False,
    ),
]

MetaDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--meta-dir",
        help="Where the journal lives, when the run put it apart from the blobs (meta_dir).",
        readable=False,
    ),
]


RemoteOpt = Annotated[
    str | None,
    typer.Option(
        "--remote",
        help="Also the remote copy: s3://bucket/prefix, file:///path... (credentials: the usual AWS_* / fsspec ones).",
        show_default=False,
    ),
]


def open_checkpoints(where: str | Path, meta_dir: Path | None) -> Any:
    """The store of a directory or a URL (``open_store``); a directory with run records but no
    store raises :class:`NothingCheckpointedError` saying so (exit 1), instead of "not a store"."""
    from smartckpt_cli.errors import NotAStoreError, NothingCheckpointedError
    from smartckpt_cli.store.directory import open_store
    from smartckpt_cli.store.storage import is_url
    from smartckpt_cli.supervise.records import runs_without_checkpoints

    if isinstance(where, str) and is_url(where):
        return open_store(where, meta_dir)
    directory = Path(where)
    try:
        return open_store(directory, meta_dir)
    except NotAStoreError:
        line = runs_without_checkpoints(directory) if directory.is_dir() else None
        if line is None:
            raise
        raise NothingCheckpointedError(line) from None


def out() -> Console:
    """stdout; tables keep their width (160 columns) when piped to a file or a pager."""
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = max(console.width, 160)
    return console


def fitted_table(
    title: str | None, columns: Sequence[Any], rows: Sequence[Sequence[str]], console: Console
) -> tuple[Any, str | None]:
    """A table of whole cells that fits ``console`` (:func:`smartckpt_cli.cli.fit.fit` picks the
    columns), and the line naming the columns it left out (None when none). Cells are plain text."""
    from rich.table import Table

    from smartckpt_cli.cli.fit import FOLD_MIN, fit, natural_width

    chosen = fit(columns, rows, console.width)
    table = Table(title=escape(title) if title else None, title_justify="left")
    for i in chosen.shown:
        c = columns[i]
        table.add_column(
            escape(c.header),
            justify=c.justify,
            no_wrap=not c.fold,
            overflow="fold" if c.fold else "ellipsis",
            min_width=min(natural_width(columns, rows, i), FOLD_MIN) if c.fold else None,
        )
    for r in rows:
        table.add_row(*(escape(r[i]) for i in chosen.shown))
    return table, chosen.note(console.width)


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def say(line: str, *, error: bool = False) -> None:
    """One plain line (no markup: paths and step ids are printed as they are)."""
    typer.echo(line, err=error)


def human(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A byte progress bar on stderr when it is a terminal; None (no output) otherwise."""
    console = err()
    if not console.is_terminal:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
