"""What every part of ``smartckpt bench`` works with, built once by :func:`.run.run_bench`: the
manager and the policy that fires its saves, the two trainers, the savers, the work directory,
the device's sync, the result the parts add to and the callbacks that report progress.

One record instead of the same eleven arguments passed to each part (run.py, alone.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smartckpt_cli.bench.result import BenchResult
from smartckpt_cli.bench.savers import DcpSaver, Rotation
from smartckpt_cli.bench.throughput import Trainer

__all__ = ["BenchContext"]


@dataclass(frozen=True)
class BenchContext:
    mgr: Any  # smartckpt's CheckpointManager, registered with ``smart`` and restored
    policy: Any  # run.py's _BenchPolicy: the bench decides when smartckpt saves
    smart: Trainer  # the model smartckpt saves
    plain: Trainer  # the model the other contenders save
    dcp: DcpSaver
    rotation: Rotation
    root: Path  # the bench's work directory
    sync: Callable[[], None]  # waits for the device (a no-op on the CPU)
    result: BenchResult
    progress: Callable[[str], None]
    on_update: Callable[[BenchResult], None]
