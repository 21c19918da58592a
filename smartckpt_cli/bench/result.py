"""What ``smartckpt bench`` measured: :class:`BenchResult` (every sample, its medians and the
JSON the CLI writes) and :data:`RATIOS`, the figures the issue's targets are stated in. Plain
records, no torch: the CLI renders them (cli/bench_view.py) without importing it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from smartckpt_cli.bench.record import Record

if TYPE_CHECKING:
    from smartckpt_cli.bench.throughput import Throughput

__all__ = ["DERIVED", "LABELS", "RATIOS", "BenchResult"]


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

    def values(self, name: str) -> list[float]:
        """A measure's samples; for a :data:`DERIVED` one, the per-repetition differences."""
        if name in DERIVED:
            a, b = (self.samples.get(n, []) for n in DERIVED[name])
            return [x - y for x, y in zip(a, b, strict=False)]
        return self.samples.get(name, [])

    def median(self, name: str) -> float | None:
        vals = self.values(name)
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

    def record(self, command: str) -> Record:
        """The result file (bench/record.py): every median, ratio, size and throughput
        figure with its unit; everything else (the samples) under ``details``."""
        info = self.info
        rec = Record(
            "bench",
            command,
            device={"type": self.device, "name": info.get("device_name", self.device)},
            torch=info.get("torch"),
        )
        rec.add("params", self.params, "count", "parameters of the bench model")
        rec.add("state_bytes", self.state_bytes, "B", "model and AdamW state, raw bytes")
        for name in [*self.samples, *DERIVED]:
            m = self.median(name)
            if m is not None:
                rec.add(name, m, "s", f"{LABELS.get(name, name)}, median of {len(self.values(name))}")
        for name, (a, b) in RATIOS.items():
            r = self.ratio(a, b)
            if r is not None:
                rec.add(f"ratio: {name}", r, "x", f"median of {a} / median of {b}")
        first = self.first_save()
        if first["ratio"] is not None:
            rec.add(
                "first_save.ratio",
                first["ratio"],
                "x",
                "first lazy save / median of the later ones (library's counter)",
            )
        for name, size in self.sizes.items():
            rec.add(f"bytes.{name}", size, "B", f"bytes on disk of one checkpoint: {name}")
        tp = self.throughput
        if tp is not None:
            for name, sps in tp.steps_per_second.items():
                what = f"throughput part, a save every {tp.every:g} s, {name}"
                rec.add(
                    f"throughput.{name}.steps_per_s",
                    statistics.median(sps),
                    "steps/s",
                    f"{what}: median over rounds",
                )
                rec.add(
                    f"throughput.{name}.ratio",
                    statistics.median(tp.ratio_vs_none[name]),
                    "x",
                    f"{what}: against no checkpointing in the same round, median",
                )
                waits = tp.loop_wait.get(name)
                if waits:
                    rec.add(
                        f"throughput.{name}.save_call_s",
                        statistics.median(waits),
                        "s",
                        f"{what}: the save call and what the next update waited (the tool's own timers), median",
                    )
        rec.notes += self.notes
        rec.details = self.to_json()
        return rec

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "state_bytes": self.state_bytes,
            "reps": self.reps,
            "device": self.device,
            **self.info,
            "parts_done": self.done,
            "complete": self.done == ["first-save", "throughput", "saves"],
            "median_seconds": {k: self.median(k) for k in [*self.samples, *DERIVED] if self.values(k)},
            "samples": self.samples,
            "bytes_on_disk": self.sizes,
            "ratios": {name: self.ratio(a, b) for name, (a, b) in RATIOS.items()},
            "first_save": self.first_save(),
            "throughput": self.throughput.to_json() if self.throughput is not None else None,
            "notes": self.notes,
        }


# What each measure is, in words (the CLI's table and the result file).
LABELS: dict[str, str] = {
    "bound.copy": "lower bound: copy into preallocated buffers",
    "bound.write+fsync": "lower bound: sequential write + fsync",
    "torch.save+fsync": "torch.save + fsync",
    "torch.load+load_state_dict": "torch.load + load_state_dict",
    "dcp.save": "DCP save",
    "dcp.load": "DCP load + set_state_dict",
    "dcp.async_save.blocking": "DCP async_save: call + wait for its staging before the next update",
    "dcp.async_save.total": "DCP async_save, total",
    "smartckpt.blocking": "smartckpt save(), blocking (eager copy)",
    "smartckpt.first_lazy_loop_wait": "smartckpt step(): the library's loop wait counter, first save",
    "smartckpt.lazy_loop_wait": "smartckpt step(): the library's loop wait counter (lazy copy)",
    "smartckpt.committed": "smartckpt, until committed",
    "smartckpt.restore": "smartckpt restore (verify + load)",
    "train_step": "one training step (fwd+bwd+AdamW), smartckpt's model",
    "train_step_with_lazy_save": "smartckpt step() saving + the next training step (lazy copy)",
    "smartckpt.eager_step_with_save": "smartckpt save() + the next training step (eager copy)",
    "train_step_plain": "one training step, the other contenders' model",
    "dcp.async_save.step_with_save": "DCP async_save + the next training step",
    "smartckpt.lazy_step_extra": "loop wait, step-time difference: smartckpt step() (lazy copy)",
    "smartckpt.eager_step_extra": "loop wait, step-time difference: smartckpt save() (eager copy)",
    "dcp.async_save.step_extra": "loop wait, step-time difference: DCP async_save",
}

# The loop wait as the training loop's clock sees it: a step with the save (the save call at the
# step boundary and the next training step, whose update waits for the copies) minus a step
# without, per repetition. name -> (with the save, without).
DERIVED: dict[str, tuple[str, str]] = {
    "smartckpt.lazy_step_extra": ("train_step_with_lazy_save", "train_step"),
    "smartckpt.eager_step_extra": ("smartckpt.eager_step_with_save", "train_step"),
    "dcp.async_save.step_extra": ("dcp.async_save.step_with_save", "train_step_plain"),
}

# name -> (numerator, denominator): the figures the targets are stated in.
RATIOS: dict[str, tuple[str, str]] = {
    "blocking / torch.save+fsync": ("smartckpt.blocking", "torch.save+fsync"),
    "blocking / copy lower bound": ("smartckpt.blocking", "bound.copy"),
    "step-time difference: lazy / DCP async_save": ("smartckpt.lazy_step_extra", "dcp.async_save.step_extra"),
    "step-time difference: eager / DCP async_save": (
        "smartckpt.eager_step_extra",
        "dcp.async_save.step_extra",
    ),
    "library's lazy loop wait counter / copy lower bound": ("smartckpt.lazy_loop_wait", "bound.copy"),
    "first / later lazy loop wait (library's counter)": (
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
