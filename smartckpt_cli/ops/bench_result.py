"""What ``smartckpt bench`` measured: :class:`BenchResult` (every sample, its medians and the
JSON the CLI writes) and :data:`RATIOS`, the figures the issue's targets are stated in. Plain
records, no torch: the CLI renders them (cli/bench_view.py) without importing it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smartckpt_cli.ops.bench_throughput import Throughput

__all__ = ["RATIOS", "BenchResult"]


@dataclass
class BenchResult:
    params: int
    state_bytes: int
    reps: int
    device: str = "cpu"
    info: dict[str, Any] = field(default_factory=dict)  # device name, torch, batch, DCP staging...
    samples: dict[str, list[float]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    throughput: Throughput | None = None
    later_lazy_waits: list[float] = field(default_factory=list)  # every lazy save after the first
    done: list[str] = field(default_factory=list)  # parts finished: first-save, throughput, saves

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        vals = self.samples.get(name)
        return statistics.median(vals) if vals else None

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.median(a), self.median(b)
        return None if x is None or not y else x / y

    def first_save(self) -> dict[str, Any]:
        """The first lazy save's loop wait against every later lazy save's (issue 20: ≤ 2x)."""
        first = self.median("smartckpt.first_lazy_loop_wait")
        later = statistics.median(self.later_lazy_waits) if self.later_lazy_waits else None
        return {
            "first_loop_wait": first,
            "later_loop_waits": self.later_lazy_waits,
            "median_later_loop_wait": later,
            "ratio": first / later if first is not None and later else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "state_bytes": self.state_bytes,
            "reps": self.reps,
            "device": self.device,
            **self.info,
            "parts_done": self.done,
            "complete": self.done == ["first-save", "throughput", "saves"],
            "median_seconds": {k: self.median(k) for k in self.samples},
            "samples": self.samples,
            "bytes_on_disk": self.sizes,
            "ratios": {name: self.ratio(a, b) for name, (a, b) in RATIOS.items()},
            "first_save": self.first_save(),
            "throughput": self.throughput.to_json() if self.throughput is not None else None,
            "notes": self.notes,
        }


# name -> (numerator, denominator): the figures the targets are stated in.
RATIOS: dict[str, tuple[str, str]] = {
    "blocking / torch.save+fsync": ("smartckpt.blocking", "torch.save+fsync"),
    "blocking / DCP async_save blocking": ("smartckpt.blocking", "dcp.async_save.blocking"),
    "blocking / copy lower bound": ("smartckpt.blocking", "bound.copy"),
    "lazy loop wait / copy lower bound": ("smartckpt.lazy_loop_wait", "bound.copy"),
    "lazy loop wait / DCP async_save blocking": ("smartckpt.lazy_loop_wait", "dcp.async_save.blocking"),
    "first lazy loop wait / later lazy loop wait": (
        "smartckpt.first_lazy_loop_wait",
        "smartckpt.lazy_loop_wait",
    ),
    "committed / torch.save+fsync": ("smartckpt.committed", "torch.save+fsync"),
    "committed / DCP save": ("smartckpt.committed", "dcp.save"),
    "committed / DCP async_save total": ("smartckpt.committed", "dcp.async_save.total"),
    "committed / write lower bound": ("smartckpt.committed", "bound.write+fsync"),
    "restore / torch.load+load_state_dict": ("smartckpt.restore", "torch.load+load_state_dict"),
    "restore / DCP load": ("smartckpt.restore", "dcp.load"),
}
