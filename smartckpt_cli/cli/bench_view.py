"""Rich rendering of a BenchResult."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from smartckpt_cli.bench import RATIOS, BenchResult

_ROWS = [
    ("bound.copy", "lower bound: copy into preallocated buffers"),
    ("bound.write+fsync", "lower bound: sequential write + fsync"),
    ("torch.save+fsync", "torch.save + fsync"),
    ("torch.load+load_state_dict", "torch.load + load_state_dict"),
    ("dcp.save", "DCP save"),
    ("dcp.async_save.blocking", "DCP async_save, blocking"),
    ("dcp.async_save.total", "DCP async_save, total"),
    ("smartckpt.blocking", "smartckpt save(), blocking (eager copy)"),
    ("smartckpt.lazy_loop_wait", "smartckpt step(), loop wait (lazy copy)"),
    ("smartckpt.committed", "smartckpt, until committed"),
    ("smartckpt.restore", "smartckpt restore (verify + load)"),
    ("train_step", "one training step (fwd+bwd+AdamW)"),
    ("train_step_with_lazy_save", "one training step right after a lazy save"),
]


def render(result: BenchResult, console: Console) -> None:
    gb = result.state_bytes / 1e9
    t = Table(title=f"{result.params / 1e6:.0f}M parameters, {gb:.2f} GB of state, median of {result.reps}")
    t.add_column("measure")
    t.add_column("seconds", justify="right")
    t.add_column("GB/s", justify="right")
    for key, label in _ROWS:
        m = result.median(key)
        if m is not None:
            t.add_row(label, f"{m:.3f}", f"{gb / m:.2f}" if m > 0 else "-")
    console.print(t)
    r = Table(title="ratios")
    r.add_column("ratio")
    r.add_column("value", justify="right")
    for name in RATIOS:
        v = result.ratio(*RATIOS[name])
        r.add_row(name, "-" if v is None else f"{v:.3f}")
    base = result.sizes.get("torch.save")
    for name, size in result.sizes.items():
        rel = f" ({size / base:.3f}x torch.save)" if base else ""
        r.add_row(f"bytes on disk: {name}", f"{size:,}{rel}")
    console.print(r)
