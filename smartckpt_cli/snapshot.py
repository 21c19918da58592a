"""The part of a save the training loop waits for: copy the state into staging buffers.

Everything after (precision reduction, encoding, hashing, writing) runs in the background on these
copies, so training may mutate its tensors again as soon as :func:`take_snapshot` returns.

Staging buffers are kept per entry and reused by the next save (memory stays flat over hundreds
of saves); the manager allows one save in flight, so a buffer is never refilled while it is still
being written. CUDA tensors go to pinned host buffers with non-blocking copies and one event that
the background thread waits on; without CUDA it is a plain copy into preallocated buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from smartckpt_cli.statetree import flatten
from smartckpt_cli.tiers import EntryPlan, TierRule, classify

__all__ = ["Item", "Snapshot", "Stager", "take_snapshot"]

logger = logging.getLogger(__name__)


@dataclass
class Item:
    plan: EntryPlan
    tensor: torch.Tensor  # the staged copy: CPU, contiguous
    dtype: torch.dtype
    shape: list[int]


@dataclass
class Snapshot:
    step: int
    reason: str
    score: float | None
    objects: dict[str, dict[str, Any]]  # name -> {"kind", "tree"}
    items: list[Item]
    meta: dict[str, Any]
    health: str = "ok"
    ready: Any = None  # a CUDA event to wait on before reading the staged tensors
    dropped: list[str] = field(default_factory=list)  # L4 keys, not stored

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class Stager:
    """Reusable host buffers, one per state entry."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = self._pin and t.device.type == "cuda"
            try:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            except RuntimeError:  # pinning can fail (locked-memory limits): degrade to pageable
                buf = torch.empty(t.shape, dtype=t.dtype)
            self._buffers[key] = buf
        return buf

    def stage(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffer(key, t)
        buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        return buf

    def forget_except(self, keys: set[str]) -> None:
        for k in [k for k in self._buffers if k not in keys]:
            del self._buffers[k]


def take_snapshot(
    objects: dict[str, tuple[str, Any]],
    *,
    stager: Stager,
    step: int,
    reason: str,
    score: float | None,
    precision: str,
    rules: tuple[TierRule, ...],
    meta: dict[str, Any],
) -> Snapshot:
    """Copy every registered object's state. ``objects``: name -> (kind, object with state_dict)."""
    trees: dict[str, dict[str, Any]] = {}
    items: list[Item] = []
    dropped: list[str] = []
    any_cuda = False
    for name, (kind, obj) in objects.items():
        tree, tensors = flatten(obj.state_dict(), name)
        trees[name] = {"kind": kind, "tree": tree}
        for key, t in tensors.items():
            plan = classify(
                key, kind, numel=t.numel(), floating=t.is_floating_point(), precision=precision, rules=rules
            )
            if not plan.stored:
                dropped.append(key)
                continue
            any_cuda |= t.device.type == "cuda"
            staged = stager.stage(key, t)
            items.append(Item(plan, staged, t.dtype, list(t.shape)))
    stager.forget_except({i.plan.key for i in items})
    ready = None
    if any_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return Snapshot(step, reason, score, trees, items, meta, ready=ready, dropped=dropped)
