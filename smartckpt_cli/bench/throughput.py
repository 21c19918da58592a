"""Training throughput with a save every N seconds, for each contender: the figure users feel.

Each contender trains in *blocks*. A block takes one training step, saves at its boundary (the
contender's own way), then trains on until ``every`` seconds have passed since the save handed
control back to the loop; the block's throughput is its steps over its wall time, the save
included. So every contender saves once per ``every`` seconds of training, the way a loop with
``if time.monotonic() - last >= every: save(); last = time.monotonic()`` does, and a blocking
save lengthens the block by what it blocks. ``none`` (no checkpointing) runs the same blocks
without the save. Background work still running when the block ends (a DCP upload, a smartckpt
persist) is waited for afterwards and reported as ``drain`` seconds: a non-zero drain means the
saves cannot keep up with the interval.

Rounds rotate the order of the contenders (A B C D, B C D A, ...) so drift in the machine's
speed, and what the previous block left behind, hits all of them alike; the ratio against
``none`` is taken within each round, then the median over rounds.

On CUDA the device is synchronised at the edges of a block only (never inside: that would stall
the queue the way no training loop does), so a block's wall time includes all its queued work.
The contenders:

* ``torch.save``: the state dicts written with ``torch.save`` + fsync, blocking;
* ``dcp.async_save``: DCP's ``async_save`` with its best staging (savers.py); the loop
  waits for the call, for the staging copy before the next optimizer update, and for the
  previous upload if it is still running when the next save is due;
* ``smartckpt``: ``mgr.step(step, loss=loss)`` at every step, as in training, with a policy that
  fires when the block's save is due (so all contenders save on the same schedule); the loop
  waits for the ``step()`` call and for the lazy copies in the next optimizer pre-hook.

smartckpt trains its own model (the manager's hooks are on its optimizer); the others share a
second model of the same size, which carries no hooks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.bench.savers import DcpSaver, PendingAsync, Rotation, TorchSaver

__all__ = ["CONTENDERS", "Throughput", "Trainer"]

CONTENDERS = ("none", "torch.save", "dcp.async_save", "smartckpt")


@dataclass
class Trainer:
    """A model and its optimizer as the bench trains them, with a step counter."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step_fn: Callable[..., torch.Tensor]
    steps: int = 0

    def step(self, before_update: Callable[[], None] | None = None) -> torch.Tensor:
        self.steps += 1
        return self.step_fn(self.model, self.opt, before_update=before_update)


@dataclass
class Throughput:
    """Per contender, one entry per round."""

    every: float
    steps_per_second: dict[str, list[float]] = field(default_factory=dict)
    ratio_vs_none: dict[str, list[float]] = field(default_factory=dict)
    loop_wait: dict[str, list[float]] = field(default_factory=dict)  # one per save
    drain: dict[str, list[float]] = field(default_factory=dict)
    block_seconds: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        def med(d: dict[str, list[float]]) -> dict[str, float | None]:
            return {k: statistics.median(v) if v else None for k, v in d.items()}

        return {
            "every_seconds": self.every,
            "rounds": len(self.steps_per_second.get("none", [])),
            "steps_per_second": self.steps_per_second,
            "median_steps_per_second": med(self.steps_per_second),
            "ratio_vs_none": self.ratio_vs_none,
            "median_ratio_vs_none": med(self.ratio_vs_none),
            "loop_wait_seconds": self.loop_wait,
            "median_loop_wait_seconds": med(self.loop_wait),
            "drain_seconds": self.drain,
            "block_seconds": self.block_seconds,
        }


class _Contender:
    """How one contender trains and saves in a block (the base class: no checkpointing)."""

    def __init__(self, name: str, trainer: Trainer) -> None:
        self.name, self.trainer = name, trainer
        self.waits: list[float] = []

    def train_step(self) -> torch.Tensor:
        return self.trainer.step()

    def boundary(self, loss: torch.Tensor, save: bool) -> None:
        """After each step; ``save`` on the block's save step."""

    def finish(self) -> float:
        """After the block: wait for background work; the seconds it took."""
        return 0.0


class _TorchSave(_Contender):
    def __init__(self, trainer: Trainer, root: Path, rotation: Rotation) -> None:
        super().__init__("torch.save", trainer)
        self.saver = TorchSaver(trainer.model, trainer.opt)
        self.root, self.rotation = root, rotation
        self.path: Path | None = None

    def boundary(self, loss: torch.Tensor, save: bool) -> None:
        if save:
            self.path = self.root / f"torch-tp-{self.trainer.steps}.pt"
            self.waits.append(self.saver.save(self.path))

    def finish(self) -> float:
        if self.path is not None:  # the delete of the previous file is not timed (Rotation)
            self.rotation.rotate("torch", self.path)
        return 0.0


class _DcpAsync(_Contender):
    def __init__(self, trainer: Trainer, dcp: DcpSaver, root: Path, rotation: Rotation) -> None:
        super().__init__("dcp.async_save", trainer)
        self.dcp, self.root, self.rotation = dcp, root, rotation
        self.pending: PendingAsync | None = None
        self.path: Path | None = None
        self._unstaged = False

    def _wait_staged(self) -> None:
        if self._unstaged and self.pending is not None:
            self.waits[-1] += self.pending.wait_staged()
            self._unstaged = False

    def train_step(self) -> torch.Tensor:
        return self.trainer.step(before_update=self._wait_staged)

    def boundary(self, loss: torch.Tensor, save: bool) -> None:
        if not save:
            return
        waited = 0.0
        if self.pending is not None and not self.pending.done():  # DCP: one save at a time
            t0 = time.perf_counter()
            self.pending.wait()
            waited = time.perf_counter() - t0
        self.path = self.root / f"dcp-async-tp-{self.trainer.steps}"
        self.pending = self.dcp.async_save(self.path)
        self.waits.append(waited + self.pending.call_seconds)
        self._unstaged = True

    def finish(self) -> float:
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.path is not None:
            self.rotation.rotate("dcp-async", self.path)
        return time.perf_counter() - t0


class _Smartckpt(_Contender):
    def __init__(self, trainer: Trainer, mgr: Any, policy: Any) -> None:
        super().__init__("smartckpt", trainer)
        self.mgr, self.policy = mgr, policy
        self._handles: list[tuple[Any, float]] = []

    def boundary(self, loss: torch.Tensor, save: bool) -> None:
        self.policy.fire = save
        t0 = time.perf_counter()
        res = self.mgr.step(self.trainer.steps, loss=loss)
        if save:
            if res.handle is None:
                raise RuntimeError("smartckpt did not save when the bench's policy fired")
            self._handles.append((res.handle, time.perf_counter() - t0))

    def finish(self) -> float:
        t0 = time.perf_counter()
        for handle, call in self._handles:
            handle.wait()
            if handle.error is not None:
                raise handle.error
            # The step() call as the loop saw it, plus what the next optimizer pre-hook waited
            # for the lazy copies.
            self.waits.append(call + handle.loop_wait_seconds - handle.blocking_seconds)
        self._handles.clear()
        return time.perf_counter() - t0


def _block(c: _Contender, every: float, sync: Callable[[], None]) -> tuple[int, float]:
    """One block (module docstring): (steps, wall seconds)."""
    sync()
    t0 = time.perf_counter()
    steps, due = 0, None
    while True:
        loss = c.train_step()
        steps += 1
        if due is None:
            c.boundary(loss, save=True)
            due = time.perf_counter() + every
        elif time.perf_counter() >= due:
            c.boundary(loss, save=False)
            break
        else:
            c.boundary(loss, save=False)
    sync()
    return steps, time.perf_counter() - t0


def run_throughput(
    *,
    plain: Trainer,
    smart: Trainer,
    mgr: Any,
    policy: Any,
    dcp: DcpSaver,
    root: Path,
    rotation: Rotation,
    every: float,
    rounds: int,
    sync: Callable[[], None],
    progress: Callable[[str], None],
    on_round: Callable[[Throughput], None],
) -> Throughput:
    contenders: list[_Contender] = [
        _Contender("none", plain),
        _TorchSave(plain, root, rotation),
        _DcpAsync(plain, dcp, root, rotation),
        _Smartckpt(smart, mgr, policy),
    ]
    out = Throughput(every)
    for r in range(rounds):
        progress(f"throughput, round {r + 1} of {rounds} (a save every {every:g} s)")
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        got: dict[str, float] = {}
        for c in order:
            first = len(c.waits)
            steps, seconds = _block(c, every, sync)
            out.drain.setdefault(c.name, []).append(c.finish())
            got[c.name] = steps / seconds
            out.steps_per_second.setdefault(c.name, []).append(steps / seconds)
            out.block_seconds.setdefault(c.name, []).append(seconds)
            out.loop_wait.setdefault(c.name, []).extend(c.waits[first:])
        for name, value in got.items():
            out.ratio_vs_none.setdefault(name, []).append(value / got["none"])
        on_round(out)
    return out
