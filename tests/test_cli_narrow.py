"""``inspect`` on a narrow terminal: whole cells, fewer columns, and a line naming the others.

The end-to-end cases run the real CLI on a real pseudo-terminal of 80 (and 200) columns."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from smartckpt_cli.cli.fit import FOLD_MIN, Column, fit, table_width

COLUMNS = [
    Column(""),
    Column("step", "right"),
    Column("time (UTC)", drop=3),
    Column("reason", drop=4),
    Column("health", drop=1),
    Column("precision", drop=10),
    Column("state", drop=1),
]
ROWS = [[">", "360000", "2026-12-07 05:00:14", "adaptive 0.53", "ok", "exact", "live"]]


def test_everything_fits_a_wide_terminal() -> None:
    chosen = fit(COLUMNS, ROWS, 200)
    assert chosen.shown == list(range(len(COLUMNS))) and chosen.left_out == []
    assert chosen.note(200) is None


def test_the_least_needed_columns_go_first_and_are_named() -> None:
    full = table_width(COLUMNS, ROWS, range(len(COLUMNS)))
    # One column too narrow: precision (drop 10) goes, nothing else.
    chosen = fit(COLUMNS, ROWS, full - 1)
    assert chosen.left_out == ["precision"]
    assert table_width(COLUMNS, ROWS, chosen.shown) <= full - 1
    note = chosen.note(full - 1)
    assert note is not None and "precision" in note and "--json" in note
    # Narrower still: reason, then time, go before health and state.
    narrow = fit(COLUMNS, ROWS, 40)
    assert narrow.left_out == ["time (UTC)", "reason", "precision"]
    assert table_width(COLUMNS, ROWS, narrow.shown) <= 40


def test_columns_that_always_stay_are_kept_even_when_they_do_not_fit() -> None:
    chosen = fit(COLUMNS, ROWS, 5)
    assert [COLUMNS[i].header for i in chosen.shown] == ["", "step"]


def test_a_folding_column_counts_its_narrowest_width() -> None:
    cols = [Column("tensor", fold=True), Column("raw", "right", drop=1)]
    rows = [["model/" + "x" * 100, "16.0 KiB"]]
    chosen = fit(cols, rows, FOLD_MIN + 20)
    assert chosen.left_out == []  # the name wraps inside its cell; the size stays


def _on_a_terminal(args: list[str], columns: int, env: dict[str, str]) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from smartckpt_cli.cli.app import main; main()", *args],
        stdout=slave,
        stderr=slave,
        env={**env, "TERM": "xterm", "COLUMNS": str(columns), "NO_COLOR": "1"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    rc = proc.wait(timeout=120)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return rc, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # styles (bold headers) are not width


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from smartckpt_cli import CheckpointManager

    where = tmp_path_factory.mktemp("narrow") / "ckpt"
    model = torch.nn.Sequential()
    model.add_module("a_rather_long_module_name_that_users_have", torch.nn.Linear(16, 16))
    opt = torch.optim.Adam(model.parameters())
    with CheckpointManager(where, keep_last=5) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in (100, 3600, 36000, 360000):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            mgr.save(step, blocking=True).wait()
    return where


def test_inspect_at_80_columns_keeps_every_cell_whole(store: Path) -> None:
    env = dict(os.environ)
    rc, text = _on_a_terminal(["inspect", str(store)], 80, env)
    assert rc == 0, text
    table = [ln for ln in text.splitlines() if ln.startswith(("│", "┃", "┏", "└"))]
    assert table and all(len(ln) <= 80 for ln in table), text
    assert "…" not in text, text
    for step in ("360000", "36000", "3600", "100"):
        assert any(f" {step} " in ln for ln in table), (step, text)
    note = [ln for ln in text.splitlines() if ln.startswith("left out at 80 columns:")]
    assert len(note) == 1 and "blobs checked" in note[0] and "precision" in note[0], text
    rc, wide = _on_a_terminal(["inspect", str(store)], 200, env)
    assert rc == 0 and "left out" not in wide and "blobs checked" in wide, wide


def test_inspect_one_step_at_80_columns_folds_long_tensor_names(store: Path) -> None:
    rc, text = _on_a_terminal(["inspect", str(store), "--step", "360000"], 80, dict(os.environ))
    assert rc == 0, text
    table = [ln for ln in text.splitlines() if ln.startswith(("│", "┃", "┏", "└"))]
    assert table and all(len(ln) <= 80 for ln in table), text
    assert "…" not in text, text
    # The name, folded in its cell, reads whole top to bottom.
    first = "".join(ln.split("│")[1].strip() for ln in table if ln.startswith("│"))
    assert "model/a_rather_long_module_name_that_users_have.weight" in first, text
