"""Training signals the trigger reads: median-filtered loss curvature, global gradient variance,
the planned update, and (attached by the manager) memory pressure.

**Cost.** A step that does not evaluate costs nothing here. Losses are kept (as detached device
tensors, no copy) only for the ``window`` steps before the next evaluation. An evaluation reduces
the gradient statistics in the optimizer step pre-hook with foreach kernels, gathers every number
into **one** device vector and reads it back in one transfer: on CPU at once (there is no stream
to stall), on CUDA by a non-blocking copy into a pinned host buffer and an event that the manager
polls at a later step (:meth:`Signals.poll`), or waits for where a decision needs the reading
before the optimizer update (the precursor, manager.py). How often evaluations run:
``eval_every`` steps when set; by default (``None``) every 10 steps, stretched when steps are
short so that evaluating costs at most :data:`EVAL_SHARE` of the training time — the manager
measures both the evaluation's host time and the step time (:meth:`Signals.charge`).

**Curvature** is the second difference of the *median-filtered* loss across the last three
evaluations: f_t = median(last ``window`` step losses at evaluation t), curv = f_t − 2·f_{t−1} +
f_{t−2}. The median (not the mean) is what makes it robust to a single odd batch, the seed's tip.

**Gradient variance** is the variance of all gradient elements of all parameters taken together:
E[g²] − E[g]², from Σg² (``_foreach_norm``) and Σg (a sum per tensor: torch has no fused signed
sum, and on CPU ``_foreach_norm`` of ord 1 or ``var_mean`` take several times as long).

It is the variance *before gradient clipping and loss scaling*. The pre-hook sees gradients after
``clip_grad_norm_`` and after a GradScaler's ``unscale_``; clipped gradients have a norm pinned at
``max_norm``, so their variance is ≈ max_norm²/n at every step and says nothing. Both clipping by
norm and (un)scaling multiply every gradient by one factor, so one reference parameter per
optimizer (its largest) carries a post-accumulate-grad hook that records its gradient norm as
backward leaves it, on evaluation steps only; the pre-hook's sums are then rescaled by
(norm at backward / (loss scale · norm at the step))². Per-value clipping (``clip_grad_value_``)
is not a uniform scale and is not undone.

**The planned update** is the norm of the step the optimizer is *about to* apply (planned.py),
reduced in the same pre-hook and read back with the other numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from smartckpt_cli.state.tree import local_tensor
from smartckpt_cli.trigger.planned import PlannedUpdate
from smartckpt_cli.trigger.reading import SignalReading

__all__ = ["EVAL_SHARE", "SignalReading", "Signals", "curvature", "median_filter"]

BASE_EVERY = 10  # steps between evaluations when eval_every is not set and steps are long
EVAL_SHARE = 0.0025  # the share of training time evaluations may take when eval_every is not set
MAX_EVERY = 10_000


def median_filter(values: list[float]) -> float:
    return statistics.median(values)


def curvature(f: list[float]) -> float | None:
    """Second difference of the last three filtered values (None with fewer than three)."""
    if len(f) < 3:
        return None
    return f[-1] - 2.0 * f[-2] + f[-3]


@dataclass
class _Pending:
    """A launched evaluation whose numbers are on their way to the host."""

    step: int
    n_losses: int
    grad_n: int | None  # elements behind Σg², Σg (None: no gradient statistics)
    planned: bool
    memory: float | None
    values: list[float] | None = None  # CPU: already on the host
    host: torch.Tensor | None = None  # CUDA: the pinned buffer the copy lands in
    event: Any = None


class Signals:
    """Collects losses and gradient statistics; :meth:`launch` starts the one readback."""

    def __init__(self, *, window: int = 5, eval_every: int | None = None) -> None:
        self.window = window
        self.eval_every = eval_every  # None: adaptive (module docstring)
        self._next: int | None = None  # adaptive: the next evaluation step
        self._launched: int | None = None  # the step of the newest launch
        self._losses: deque[torch.Tensor] = deque(maxlen=window)
        self._filtered: deque[float] = deque(maxlen=3)
        self._grad: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (Σg², Σg, n)
        self._update: torch.Tensor | None = None  # Σ over optimizers of the planned update²
        self._armed = False
        self._ref: dict[int, tuple[torch.Tensor, Any]] = {}  # id(optimizer) -> (ref param, hook)
        self._ref_norm: dict[int, torch.Tensor] = {}  # id(ref param) -> its norm after backward
        self._pending: _Pending | None = None
        self._host: torch.Tensor | None = None  # pinned readback buffer (CUDA)
        self._planned = PlannedUpdate()
        # Measured by the manager: seconds of host time per evaluation, seconds per step.
        self.cost = 0.0
        self.step_time = 0.0
        self.every = eval_every or BASE_EVERY  # the current spacing, for logs and the trace
        self.agreed: int | None = None  # several ranks: the spacing rank 0 chose (stepping.py)

    # ---------------------------------------------------------------- cadence

    def due(self, step: int) -> bool:
        """Whether ``step`` evaluates (False once its evaluation was launched)."""
        if step == self._launched:
            return False
        if self.eval_every is not None:
            return step % self.eval_every == 0
        if self._next is None:
            self._next = -(-step // BASE_EVERY) * BASE_EVERY  # the first multiple of 10 from here
        return step >= self._next

    def next_due(self, step: int) -> int:
        """The first step from ``step`` on that evaluates (as the schedule stands now)."""
        if self.eval_every is not None:
            nxt = -(-step // self.eval_every) * self.eval_every
            return nxt if nxt != self._launched else nxt + self.eval_every
        if self._next is None:
            self.due(step)
        assert self._next is not None
        return max(step, self._next)

    def keeps_loss(self, step: int) -> bool:
        """Whether the loss of ``step`` can reach the window of the next evaluation (the
        evaluation may run in the next step's optimizer pre-hook: one step of slack)."""
        if self.eval_every is not None:
            nxt = -(-step // self.eval_every) * self.eval_every
        else:
            if self._next is None:
                self.due(step)
            nxt = self._next if self._next is not None else step
        return step >= nxt - self.window

    def charge(self, seconds: float) -> None:
        """The host time one evaluation took (reductions, readback, the trigger's look at it)."""
        self.cost = seconds if self.cost == 0.0 else 0.7 * self.cost + 0.3 * seconds

    def _spacing(self) -> int:
        if self.eval_every is None and self.agreed is not None:
            return self.agreed  # several ranks: rank 0's (they evaluate at the same steps)
        return self.own_spacing()

    def own_spacing(self) -> int:
        """The spacing this process's own measurements ask for."""
        if self.eval_every is not None:
            return self.eval_every
        if self.step_time <= 0.0 or self.cost <= 0.0:
            return BASE_EVERY
        return min(MAX_EVERY, max(BASE_EVERY, math.ceil(self.cost / (EVAL_SHARE * self.step_time))))

    # ---------------------------------------------------------------- collection

    def watch(self, optimizer: Any) -> None:
        """Choose the optimizer's largest parameter, to undo clipping and loss scaling; its hook is
        on only while armed (a hook that runs at every backward is a cost of every step)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params or id(optimizer) in self._ref:
            return
        ref = max(params, key=lambda p: p.numel())
        if not hasattr(ref, "register_post_accumulate_grad_hook"):
            return
        self._ref[id(optimizer)] = (ref, None)
        if self._armed:
            self._hook(True)

    def _hook(self, on: bool) -> None:
        for key, (ref, handle) in list(self._ref.items()):
            if on and handle is None:
                self._ref[key] = (ref, ref.register_post_accumulate_grad_hook(self._after_backward))
            elif not on and handle is not None:
                handle.remove()
                self._ref[key] = (ref, None)

    def _after_backward(self, p: torch.Tensor) -> None:
        # Runs for every backward (micro-batches too): the last one before the step wins.
        if self._armed and p.grad is not None and not p.grad.is_sparse:
            self._ref_norm[id(p)] = torch.linalg.vector_norm(p.grad.detach().float())

    def arm(self, due_next: bool) -> None:
        """Called at each step boundary the manager looks at: record reference norms during the
        next backward?"""
        if due_next != self._armed:
            self._hook(due_next)
        self._armed = due_next
        if not due_next and self._ref_norm:
            self._ref_norm.clear()

    def unwatch(self) -> None:
        self._hook(False)
        self._ref.clear()
        self._ref_norm.clear()

    def add_loss(self, loss: torch.Tensor | float) -> None:
        t = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._losses.append(t)

    def collect_grads(self, optimizer: Any, loss_scale: torch.Tensor | float | None = None) -> None:
        """Reduce an optimizer's gradients on the device (no host sync); called from its step
        pre-hook on the step before an evaluation. Several optimizers pool their statistics.
        ``loss_scale``: a GradScaler's current scale (its gradients at backward are scaled)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        # Local shards of DTensor gradients (FSDP2): statistics never start a collective here.
        grads = [local_tensor(p.grad.to_dense() if p.grad.is_sparse else p.grad) for p in params]
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # one fused kernel on CUDA
        sq = torch.stack(norms).square()  # Σg² per tensor
        sumsq = sq.sum()
        total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
        n = sum(g.numel() for g in grads)
        ref = self._ref.get(id(optimizer))
        at_backward = self._ref_norm.pop(id(ref[0]), None) if ref is not None else None
        if ref is not None and at_backward is not None:
            i = next((i for i, p in enumerate(params) if p is ref[0]), None)
            if i is not None:
                now = norms[i] * (1.0 if loss_scale is None else loss_scale)
                # 1/c for a clip factor c (exactly 1 without clipping); left alone at zero norm
                undo = torch.where(now > 0, at_backward.to(now.device) / now, torch.ones_like(now))
                sumsq, total = sumsq * undo * undo, total * undo
        planned = self._planned.squared(optimizer, params, sq)
        if planned is not None:
            self._update = planned if self._update is None else self._update + planned.to(self._update.device)
        if self._grad is not None:
            prev_sq, prev_sum, prev_n = self._grad
            sumsq, total, n = sumsq + prev_sq.to(sumsq.device), total + prev_sum.to(total.device), n + prev_n
        self._grad = (sumsq, total, n)

    # ---------------------------------------------------------------- readback

    def launch(self, step: int, *, memory: float | None = None) -> None:
        """Gather the window's losses and the gradient sums into one vector and start its
        transfer to the host; schedule the next evaluation. A previous launch not yet polled is
        finished first (its reading is dropped: the trigger wants the newest)."""
        if self._pending is not None:
            self.poll(wait=True)
        parts: list[torch.Tensor] = list(self._losses)
        grad, planned = self._grad, self._update
        self._grad = self._update = None
        if grad is not None:
            parts += [grad[0], grad[1]]
        if planned is not None:
            parts.append(planned)
        self._launched = step
        self.every = self._spacing()
        if self.eval_every is None:
            self._next = step + self.every
        pending = _Pending(
            step, len(self._losses), grad[2] if grad is not None else None, planned is not None, memory
        )
        self._pending = pending
        if not parts:
            pending.values = []
            return
        dev = local_tensor(parts[0]).device
        # A DTensor here (a statistic derived from FSDP2 state) counts by its local value: no
        # collective is ever started from the signals.
        vec = torch.stack([local_tensor(p).to(dev).float().reshape(()) for p in parts])
        if dev.type != "cuda":
            pending.values = vec.tolist()  # CPU: computed already, nothing to wait for
            return
        host = self._host
        if host is None or host.numel() < vec.numel():
            try:
                host = torch.empty(max(64, vec.numel()), dtype=torch.float32, pin_memory=True)
            except RuntimeError:  # no pinned memory: a pageable copy (the host waits for it)
                host = torch.empty(max(64, vec.numel()), dtype=torch.float32)
            self._host = host
        pending.host = host
        stream = torch.cuda.current_stream(dev)  # the copy's stream: the one vec's device uses now
        host[: vec.numel()].copy_(vec, non_blocking=True)
        pending.event = torch.cuda.Event()
        pending.event.record(stream)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def poll(self, *, wait: bool = False) -> SignalReading | None:
        """The reading of the launched evaluation once its numbers are on the host (``wait``:
        block until they are); None when nothing is launched or, without ``wait``, not yet."""
        p = self._pending
        if p is None:
            return None
        if p.values is None:
            if not p.event.query():
                if not wait:
                    return None
                p.event.synchronize()
            assert p.host is not None
            count = p.n_losses + (2 if p.grad_n is not None else 0) + (1 if p.planned else 0)
            p.values = p.host[:count].tolist()
        self._pending = None
        return self._reading(p, p.values)

    def evaluate(self, step: int, *, memory: float | None = None) -> SignalReading:
        """Launch and wait: the reading of ``step`` now (one host sync on CUDA)."""
        self.launch(step, memory=memory)
        reading = self.poll(wait=True)
        assert reading is not None
        return reading

    def _reading(self, p: _Pending, host: list[float]) -> SignalReading:
        losses = host[: p.n_losses]
        rest = host[p.n_losses :]
        update = math.sqrt(max(rest.pop(), 0.0)) if p.planned else None
        var = None
        if p.grad_n is not None:
            sumsq, total = rest[0], rest[1]
            var = max(0.0, sumsq / p.grad_n - (total / p.grad_n) ** 2)
        finite = [x for x in losses if math.isfinite(x)]
        filtered = median_filter(finite) if finite else None
        if filtered is not None:
            self._filtered.append(filtered)
        return SignalReading(
            p.step,
            filtered,
            curvature(list(self._filtered)),
            var,
            raw_loss=losses[-1] if losses else None,
            update=update,
            memory=p.memory,
        )
