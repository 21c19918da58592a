"""Rich rendering of a BenchResult."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from smartckpt_cli.bench.result import LABELS, RATIOS, BenchResult

_NOT_A_TRANSFER = {
    "train_step",
    "train_step_with_lazy_save",
    "smartckpt.eager_step_with_save",
    "train_step_plain",
    "dcp.async_save.step_with_save",
    "smartckpt.lazy_step_extra",
    "smartckpt.eager_step_extra",
    "dcp.async_save.step_extra",
}


def render(result: BenchResult, console: Console) -> None:
    gb = result.state_bytes / 1e9
    info = result.info
    where = info.get("device_name", result.device)
    console.print(
        f"device: {result.device} ({where}), torch {info.get('torch', '?')}, batch {info.get('batch', '?')}; "
        f"DCP async_save staging: {info.get('dcp_async_staging', '?')}",
        highlight=False,
    )
    t = Table(title=f"{result.params / 1e6:.0f}M parameters, {gb:.2f} GB of state, median of {result.reps}")
    t.add_column("measure")
    t.add_column("seconds", justify="right")
    t.add_column("GB/s", justify="right")
    for key, label in LABELS.items():
        m = result.median(key)
        if m is not None:
            t.add_row(label, f"{m:.3f}", f"{gb / m:.2f}" if m > 0 and key not in _NOT_A_TRANSFER else "-")
    console.print(t)
    tp = result.throughput
    if tp is not None and tp.steps_per_second:
        n = len(tp.steps_per_second["none"])
        w = Table(title=f"training throughput, a save every {tp.every:g} s (median of {n} rotated rounds)")
        for col in (
            "contender",
            "steps/s",
            "vs. no checkpoint",
            "saves",
            "loop wait per save, s",
            "drain, s",
        ):
            w.add_column(col, justify="left" if col == "contender" else "right")
        for name, sps in tp.steps_per_second.items():
            waits = tp.loop_wait.get(name, [])
            w.add_row(
                name,
                f"{statistics.median(sps):.3f}",
                f"{statistics.median(tp.ratio_vs_none[name]):.4f}",
                str(len(waits)),
                f"{statistics.median(waits):.3f}" if waits else "-",
                f"{max(tp.drain.get(name, [0.0])):.2f}",
            )
        console.print(w)
    r = Table(title="ratios")
    r.add_column("ratio")
    r.add_column("value", justify="right")
    for name in RATIOS:
        v = result.ratio(*RATIOS[name])
        r.add_row(name, "-" if v is None else f"{v:.3f}")
    first = result.first_save()
    if first["ratio"] is not None:
        r.add_row("first lazy loop wait / every later lazy save's (median)", f"{first['ratio']:.3f}")
    base = result.sizes.get("torch.save")
    for name, size in result.sizes.items():
        rel = f" ({size / base:.3f}x torch.save)" if base else ""
        r.add_row(f"bytes on disk: {name}", f"{size:,}{rel}")
    console.print(r)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
