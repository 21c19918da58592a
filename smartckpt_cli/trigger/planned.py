"""The planned update, a signal for the trigger: the norm of the step the optimizer is *about
to* apply, taken in its step pre-hook (signals.py calls :meth:`PlannedUpdate.squared` from
``Signals.collect_grads``; its square is read back with the other sums).

It is estimated from the gradients the optimizer will consume (after clipping: this is what
moves the weights). For parameters with Adam's second moment (``exp_avg_sq``) the step per tensor p is
≈ lr·g/sqrt(v̂), whose squared norm is taken per tensor as lr²·n_p·Σg_p² / (Σv_p/bc + n_p·eps²),
with Σv as Adam will hold it after this step, β₂·Σv + (1 − β₂)·Σg², and bc = 1 − β₂^t its bias
correction: a gradient far above its running RMS raises the planned step up to 1/sqrt(1 − β₂)
fold, as it raises the real one. For any other parameter it is SGD's lr·‖g‖. A gradient surge
or a learning rate that jumps shows here *before* the weights change — the one moment a save
still holds the state from before the update. It costs one more pass over memory (Σv: one fused
``_foreach_norm`` of ord 1 on CUDA, a sum per tensor on CPU); the per-tensor arithmetic runs on
vectors, a parameter group at a time, with the group's settings as scalars. A learning rate held
as a device tensor is skipped (reading it would sync). Under FSDP2 each rank plans from its local
shards, like the variance.
"""

from __future__ import annotations

from typing import Any

import torch

from smartckpt_cli.state.tree import local_tensor

__all__ = ["PlannedUpdate"]


class PlannedUpdate:
    """Plans the update on the device; keeps the per-group element counts it needs (cached)."""

    def __init__(self) -> None:
        self._numels: dict[tuple[int, ...], torch.Tensor] = {}  # n per tensor of a group, cached

    def _group_numels(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        key = tuple(id(p) for p in params)
        n = self._numels.get(key)
        if n is None or n.device != device:
            host = torch.tensor([float(local_tensor(p).numel()) for p in params])
            if device.type == "cuda":  # once per group: no host wait for it either
                host = host.pin_memory()
            n = host.to(device, non_blocking=True)
            self._numels[key] = n
        return n

    def squared(self, optimizer: Any, params: list[torch.Tensor], sq: torch.Tensor) -> torch.Tensor | None:
        """Σ over ``params`` of the squared norm of the update the optimizer is about to apply
        (the module docstring), on the device: ``sq`` holds each tensor's Σg². None when no
        parameter group has a host learning rate."""
        terms: list[torch.Tensor] = []
        start = 0
        with_grad = {id(p) for p in params}
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in with_grad]
            if not mine:
                continue
            # ``params`` lists the groups' parameters in order: this group's are one slice.
            sl = sq[start : start + len(mine)]
            start += len(mine)
            lr = _host_number(group.get("lr"))
            if lr is None:
                continue
            betas = group.get("betas")
            beta2 = float(betas[1]) if isinstance(betas, tuple | list) and len(betas) == 2 else 0.999
            # Adam's eps is a number; other optimizers use the name for other things (Adafactor's
            # is a pair): those plan SGD's step below anyway.
            eps_raw = group.get("eps", 1e-8)
            eps = float(eps_raw) if isinstance(eps_raw, int | float) else 1e-8
            moments, steps = [], set()
            for p in mine:
                state = optimizer.state.get(p) or {}
                v = state.get("exp_avg_sq")
                if not (isinstance(v, torch.Tensor) and v.shape == p.shape and not v.is_sparse):
                    break
                moments.append(local_tensor(v))
                steps.add(_host_number(state.get("step")))
            if len(moments) < len(mine) or len(steps) != 1:
                # Not every tensor has Adam's moment yet (or they are at different steps): each
                # tensor planned on its own, as SGD where it has none.
                terms.extend(_planned_per_tensor(optimizer, mine, sl, lr, beta2, eps))
                continue
            (t,) = steps
            bc = 1.0 - beta2 ** (t + 1) if t is not None and 0.0 < beta2 < 1.0 else 1.0
            if sl.device.type == "cuda":
                vsum = torch.stack(torch._foreach_norm(moments, 1, dtype=torch.float32))  # v ≥ 0: its sum
            else:
                # a plain sum per tensor: on CPU ``_foreach_norm`` of ord 1 takes 3x as long
                vsum = torch.stack([v.sum(dtype=torch.float32) for v in moments])
            n = self._group_numels(mine, sl.device)
            # v̂ after this step, summed: (β₂·Σv + (1 − β₂)·Σg²)/bc, plus n·eps² for Adam's eps
            denom = vsum * (beta2 / bc) + sl * ((1.0 - beta2) / bc) + n * (eps * eps)
            # an all-zero moment (a parameter that never had a gradient) plans no Adam step yet
            ratio = torch.where(denom > 0, sl * n / denom.clamp_min(1e-38), torch.zeros_like(denom))
            terms.append(ratio.sum() * (lr * lr))
        if not terms:
            return None
        dev = terms[0].device
        return torch.stack([t.to(dev) for t in terms]).sum()


def _host_number(x: Any) -> float | None:
    """A Python number, or a CPU tensor's value; None for a device tensor (reading it would sync)."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" and x.numel() == 1 else None
    return float(x) if isinstance(x, int | float) else None


def _planned_per_tensor(
    optimizer: Any, params: list[torch.Tensor], sq: torch.Tensor, lr: float, beta2: float, eps: float
) -> list[torch.Tensor]:
    """The planned update² of each tensor of one group, one at a time (the rare case: moments
    missing for some, or at different steps)."""
    out = []
    for i, p in enumerate(params):
        s = sq[i]
        state = optimizer.state.get(p) or {}
        v = state.get("exp_avg_sq")
        if isinstance(v, torch.Tensor) and v.shape == p.shape and not v.is_sparse:
            local = local_tensor(v)
            n = float(local.numel())
            t = _host_number(state.get("step"))
            bc = 1.0 - beta2 ** (t + 1) if t is not None and 0.0 < beta2 < 1.0 else 1.0
            denom = local.sum(dtype=torch.float32) * (beta2 / bc) + s * ((1.0 - beta2) / bc) + n * eps * eps
            out.append(
                torch.where(denom > 0, s * (lr * lr * n) / denom.clamp_min(1e-38), torch.zeros_like(s))
            )
        else:
            out.append(s * (lr * lr))
    return out
