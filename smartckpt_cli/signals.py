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

It is the variance *before gradient clipping and loss scaling*. The pre-hook sees gradients after
``clip_grad_norm_`` and after a GradScaler's ``unscale_``; clipped gradients have a norm pinned at
``max_norm``, so their variance is ≈ max_norm²/n at every step and says nothing. Both clipping by
norm and (un)scaling multiply every gradient by one factor, so one reference parameter per
optimizer (its largest) carries a post-accumulate-grad hook that records its gradient norm as
backward leaves it, on evaluation steps only; the pre-hook's sums are then rescaled by
(norm at backward / (loss scale · norm at the step))². Per-value clipping (``clip_grad_value_``)
is not a uniform scale and is not undone.

The planned update is the norm of the step the optimizer is *about to* apply, estimated in the
same pre-hook from the gradients it will consume (after clipping: this is what moves the
weights). For parameters with Adam's second moment (``exp_avg_sq``) the step per tensor p is
≈ lr·g/sqrt(v̂), whose squared norm is taken per tensor as lr²·n_p·Σg_p² / (Σv_p/bc + n_p·eps²),
with Σv as Adam will hold it after this step, β₂·Σv + (1 − β₂)·Σg², and bc = 1 − β₂^t its bias
correction: a gradient far above its running RMS raises the planned step up to 1/sqrt(1 − β₂)
fold, as it raises the real one. For any other parameter it is SGD's lr·‖g‖. A gradient surge
or a learning rate that jumps shows here *before* the weights change — the one moment a save
still holds the state from before the update. It costs one more pass over memory (Σv), on
evaluation steps only. A learning rate held as a device tensor is skipped (reading it would
sync). Under FSDP2 each rank plans from its local shards, like the variance.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from smartckpt_cli.distributed import local_tensor

__all__ = ["SignalReading", "Signals", "curvature", "median_filter"]


@dataclass(frozen=True)
class SignalReading:
    step: int
    loss: float | None  # median-filtered loss at this evaluation
    curvature: float | None  # None until three evaluations exist
    grad_var: float | None
    raw_loss: float | None = None  # the newest step's loss, unfiltered
    update: float | None = None  # norm of the update planned at this step (module docstring)


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
        self._update: torch.Tensor | None = None  # Σ over optimizers of the planned update²
        self._armed = False
        self._ref: dict[int, tuple[torch.Tensor, Any]] = {}  # id(optimizer) -> (ref param, hook)
        self._ref_norm: dict[int, torch.Tensor] = {}  # id(ref param) -> its norm after backward

    def watch(self, optimizer: Any) -> None:
        """Hook the optimizer's largest parameter, to undo clipping and loss scaling."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params or id(optimizer) in self._ref:
            return
        ref = max(params, key=lambda p: p.numel())
        if not hasattr(ref, "register_post_accumulate_grad_hook"):
            return
        self._ref[id(optimizer)] = (ref, ref.register_post_accumulate_grad_hook(self._after_backward))

    def _after_backward(self, p: torch.Tensor) -> None:
        # Runs for every backward (micro-batches too): the last one before the step wins.
        if self._armed and p.grad is not None and not p.grad.is_sparse:
            self._ref_norm[id(p)] = torch.linalg.vector_norm(p.grad.detach().float())

    def arm(self, due_next: bool) -> None:
        """Called at each step boundary: record reference norms during the next backward?"""
        self._armed = due_next
        if not due_next:
            self._ref_norm.clear()

    def unwatch(self) -> None:
        for _, handle in self._ref.values():
            handle.remove()
        self._ref.clear()
        self._ref_norm.clear()

    def due(self, step: int) -> bool:
        return step % self.eval_every == 0

    def add_loss(self, loss: torch.Tensor | float) -> None:
        t = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._losses.append(t.float())

    def collect_grads(self, optimizer: Any, loss_scale: torch.Tensor | float | None = None) -> None:
        """Reduce an optimizer's gradients on the device (no host sync); called from its step
        pre-hook on the step before an evaluation. Several optimizers pool their statistics.
        ``loss_scale``: a GradScaler's current scale (its gradients at backward are scaled)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        # Local shards of DTensor gradients (FSDP2): statistics never start a collective here.
        grads = [local_tensor(p.grad.to_dense() if p.grad.is_sparse else p.grad) for p in params]
        norms = torch._foreach_norm(grads, 2)
        sumsq = torch.stack([n.float() for n in norms]).pow(2).sum()
        total = torch.stack([g.float().sum() for g in grads]).sum()
        n = sum(g.numel() for g in grads)
        ref = self._ref.get(id(optimizer))
        at_backward = self._ref_norm.pop(id(ref[0]), None) if ref is not None else None
        if ref is not None and at_backward is not None:
            i = next((i for i, p in enumerate(params) if p is ref[0]), None)
            if i is not None:
                now = norms[i].float() * (1.0 if loss_scale is None else loss_scale)
                # 1/c for a clip factor c (exactly 1 without clipping); left alone at zero norm
                undo = torch.where(now > 0, at_backward.to(now.device) / now, torch.ones_like(now))
                sumsq, total = sumsq * undo * undo, total * undo
        planned = _planned_update_sq(optimizer, params, norms)
        if planned is not None:
            self._update = planned if self._update is None else self._update + planned.to(self._update.device)
        if self._grad is not None:
            prev_sq, prev_sum, prev_n = self._grad
            sumsq, total, n = sumsq + prev_sq.to(sumsq.device), total + prev_sum.to(total.device), n + prev_n
        self._grad = (sumsq, total, n)

    def evaluate(self, step: int) -> SignalReading:
        """Move the window's losses and the gradient sums to the host in one transfer."""
        parts: list[torch.Tensor] = list(self._losses)
        grad, planned = self._grad, self._update
        self._grad = self._update = None
        if grad is not None:
            dev = parts[0].device if parts else grad[0].device
            parts += [grad[0].to(dev), grad[1].to(dev)]
        if planned is not None:
            parts.append(planned.to(parts[0].device) if parts else planned)
        if not parts:
            return SignalReading(step, None, None, None)
        dev = parts[0].device
        # A DTensor here (a statistic derived from FSDP2 state) counts by its local value: no
        # collective is ever started from the signals.
        host = torch.stack([local_tensor(p).to(dev).float() for p in parts]).tolist()  # the one sync
        losses = host[: len(self._losses)]
        update = None
        if planned is not None:
            update = math.sqrt(max(host.pop(), 0.0))
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
            update=update,
        )


def _host_number(x: Any) -> float | None:
    """A Python number, or a CPU tensor's value; None for a device tensor (reading it would sync)."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" and x.numel() == 1 else None
    return float(x) if isinstance(x, int | float) else None


def _planned_update_sq(optimizer: Any, params: list[torch.Tensor], norms: Any) -> torch.Tensor | None:
    """Σ over ``params`` of the squared norm of the update the optimizer is about to apply (see
    the module docstring), on the device: ``norms`` are the per-tensor gradient norms already
    taken. None when no parameter group has a host learning rate."""
    index = {id(p): i for i, p in enumerate(params)}
    adam_sq: list[torch.Tensor] = []  # Σg² per tensor with an Adam second moment
    adam_v: list[torch.Tensor] = []
    old_w: list[float] = []  # β₂/bc: the moment so far, in v̂ after this step
    new_w: list[float] = []  # (1 − β₂)/bc: this step's g², in v̂ after this step
    eps_n: list[float] = []
    adam_w: list[float] = []  # lr²·n per tensor
    plain: list[torch.Tensor] = []  # lr²·Σg² per tensor without one
    for group in optimizer.param_groups:
        lr = _host_number(group.get("lr"))
        if lr is None:
            continue
        betas = group.get("betas")
        beta2 = float(betas[1]) if isinstance(betas, tuple | list) and len(betas) == 2 else 0.999
        eps = float(group.get("eps", 1e-8) or 0.0)
        for p in group["params"]:
            i = index.get(id(p))
            if i is None:
                continue
            sq = norms[i].float().pow(2)
            state = optimizer.state.get(p) or {}
            v = state.get("exp_avg_sq")
            if isinstance(v, torch.Tensor) and v.shape == p.shape and not v.is_sparse:
                t = _host_number(state.get("step"))
                local = local_tensor(v)
                n = local.numel()  # the shard's, as Σg² and Σv are the shard's
                adam_sq.append(sq)
                adam_v.append(local)
                bc = 1.0 - beta2 ** (t + 1) if t is not None and 0.0 < beta2 < 1.0 else 1.0
                old_w.append(beta2 / bc)
                new_w.append((1.0 - beta2) / bc)
                eps_n.append(n * eps * eps)
                adam_w.append(lr * lr * n)
            else:
                plain.append(sq * (lr * lr))
    terms = plain
    if adam_v:
        # Σv per tensor: a plain sum (on CPU ``_foreach_norm`` of ord 1 took 3x as long)
        vsum = [v.sum(dtype=torch.float32) for v in adam_v]
        scaled = torch._foreach_add(
            torch._foreach_add(
                torch._foreach_mul([x.float() for x in vsum], old_w), torch._foreach_mul(adam_sq, new_w)
            ),
            eps_n,
        )
        # an all-zero moment (a parameter that never had a gradient) plans no Adam step yet
        denom = [torch.where(d > 0, d, torch.full_like(d, math.inf)) for d in scaled]
        terms = terms + list(torch._foreach_mul(torch._foreach_div(adam_sq, denom), adam_w))
    if not terms:
        return None
    dev = terms[0].device
    return torch.stack([t.to(dev) for t in terms]).sum()
