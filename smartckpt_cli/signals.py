"""Training signals the trigger reads: median-filtered loss curvature and global gradient variance.

Both stay on the device between evaluations. Every step's loss is kept as a detached tensor in a
window of ``window`` (default 5); the gradient statistics are reduced with foreach ops in the
optimizer step pre-hook of an evaluation step, before the optimizer consumes the gradients. An
evaluation (every ``eval_every`` steps) then moves everything to the host in **one**
synchronisation: the window's losses and the two gradient sums.

Curvature is the second difference of the *median-filtered* loss across the last three
evaluations: f_t = median(last ``window`` step losses at evaluation t), curv = f_t − 2·f_{t−1} +
f_{t−2}. The median (not the mean) is what makes it robust to a single odd batch, the seed's tip.

Gradient variance is the variance of all gradient elements of all parameters taken together:
E[g²] − E[g]², from Σg² (``_foreach_norm``) and Σg.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SignalReading", "Signals", "curvature", "median_filter"]


@dataclass(frozen=True)
class SignalReading:
    step: int
    loss: float | None  # median-filtered loss at this evaluation
    curvature: float | None  # None until three evaluations exist
    grad_var: float | None
    raw_loss: float | None = None  # the newest step's loss, unfiltered


def median_filter(values: list[float]) -> float:
    return statistics.median(values)


def curvature(f: list[float]) -> float | None:
    """Second difference of the last three filtered values (None with fewer than three)."""
    if len(f) < 3:
        return None
    return f[-1] - 2.0 * f[-2] + f[-3]


class Signals:
    """Collects losses and gradient statistics; ``evaluate`` is the one host sync."""

    def __init__(self, *, window: int = 5, eval_every: int = 10) -> None:
        self.window = window
        self.eval_every = max(1, eval_every)
        self._losses: deque[torch.Tensor] = deque(maxlen=window)
        self._filtered: deque[float] = deque(maxlen=3)
        self._grad: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (Σg², Σg, n)

    def due(self, step: int) -> bool:
        return step % self.eval_every == 0

    def add_loss(self, loss: torch.Tensor | float) -> None:
        t = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._losses.append(t.float())

    def collect_grads(self, optimizer: Any) -> None:
        """Reduce an optimizer's gradients on the device (no host sync); called from its step
        pre-hook on the step before an evaluation. Several optimizers pool their statistics."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        grads = [g.to_dense() if g.is_sparse else g for g in grads]
        norms = torch._foreach_norm(grads, 2)
        sumsq = torch.stack([n.float() for n in norms]).pow(2).sum()
        total = torch.stack([g.float().sum() for g in grads]).sum()
        n = sum(g.numel() for g in grads)
        if self._grad is not None:
            prev_sq, prev_sum, prev_n = self._grad
            sumsq, total, n = sumsq + prev_sq.to(sumsq.device), total + prev_sum.to(total.device), n + prev_n
        self._grad = (sumsq, total, n)

    def evaluate(self, step: int) -> SignalReading:
        """Move the window's losses and the gradient sums to the host in one transfer."""
        parts: list[torch.Tensor] = list(self._losses)
        grad = self._grad
        self._grad = None
        if grad is not None:
            dev = parts[0].device if parts else grad[0].device
            parts += [grad[0].to(dev), grad[1].to(dev)]
        if not parts:
            return SignalReading(step, None, None, None)
        dev = parts[0].device
        host = torch.stack([p.to(dev).float() for p in parts]).tolist()  # the one synchronisation
        losses = host[: len(self._losses)]
        var = None
        if grad is not None:
            sumsq, total = host[-2], host[-1]
            n = grad[2]
            var = max(0.0, sumsq / n - (total / n) ** 2)
        finite = [x for x in losses if math.isfinite(x)]
        filtered = median_filter(finite) if finite else None
        if filtered is not None:
            self._filtered.append(filtered)
        return SignalReading(
            step,
            filtered,
            curvature(list(self._filtered)),
            var,
            raw_loss=losses[-1] if losses else None,
        )
