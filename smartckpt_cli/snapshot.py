"""The part of a save the training loop waits for: copy the state into staging buffers.

Everything after (precision reduction, encoding, hashing, writing) runs in the background on these
copies, so training may mutate its tensors again as soon as the copy is done.

Two paths:

* **eager** (``save()`` outside a training step, ``blocking=True``, or nothing to guard the
  state): every tensor is copied before :func:`take_snapshot` returns.
* **lazy** (``mgr.step()`` with registered optimizers, the idea of DataStates-LLM's lazy copies):
  parameters owned by a registered optimizer and the optimizer's own state change only inside
  ``optimizer.step()``. Their copy is deferred to the background (CPU: the save thread copies
  them first; CUDA: a side stream copies them, ordered after the current stream) and the
  optimizer step *pre-hook* waits only for what is not yet copied (:meth:`Snapshot.guard`). The
  loop then waits only when a copy is slower than a whole forward+backward. Everything else —
  buffers that forward mutates (BatchNorm statistics), parameters no registered optimizer owns,
  schedulers, RNG, data position — is copied eagerly.

Staging buffers are kept per entry and reused by the next save (memory stays flat over hundreds
of saves); the manager allows one save in flight, so a buffer is never refilled while it is still
being written. CUDA tensors go to pinned host buffers with non-blocking copies and events;
without CUDA it is a plain copy into preallocated buffers.
"""

from __future__ import annotations

import logging
import threading
import time
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
    lazy: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (buffer, live)
    lazy_event: Any = None  # CUDA: the side-stream copy of the lazy tensors
    copied: threading.Event = field(default_factory=threading.Event)
    guard_seconds: float = 0.0  # time the optimizer pre-hook waited for the lazy copies
    blocking_seconds: float = 0.0  # time save() blocked the caller (set by the manager)
    calm: bool = True  # the trigger saw calm signals: a known-good candidate for retention

    def finish_copies(self) -> None:
        """Background side of the lazy path: copy what the snapshot deferred (CPU), then let the
        optimizer step go on. Always releases the guard, even if a copy fails."""
        try:
            for buf, live in self.lazy:
                if live.device.type != "cuda":
                    buf.copy_(live)
        finally:
            self.copied.set()

    def guard(self) -> None:
        """Optimizer step pre-hook: block until the deferred copies are done."""
        if self.copied.is_set():
            return
        t0 = time.perf_counter()
        if self.lazy_event is not None:
            # CUDA: make the compute stream wait for the copy stream; the host does not block.
            torch.cuda.current_stream().wait_event(self.lazy_event)
            if all(live.device.type == "cuda" for _, live in self.lazy):
                return
        self.copied.wait()
        self.guard_seconds += time.perf_counter() - t0

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        self.finish_copies()
        if self.lazy_event is not None:
            self.lazy_event.synchronize()


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

    def reserve(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The buffer for a lazy copy, not filled yet."""
        return self._buffer(key, t)

    def copy_stream(self) -> Any:
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream()
        return self._stream

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
    lazy_params: set[int] | None = None,
) -> Snapshot:
    """Copy every registered object's state. ``objects``: name -> (kind, object with state_dict).

    ``lazy_params``: the storage pointers of parameters guarded by an optimizer pre-hook; given,
    those and the optimizers' state are copied lazily (see module docstring), else all eagerly."""
    trees: dict[str, dict[str, Any]] = {}
    items: list[Item] = []
    dropped: list[str] = []
    lazy: list[tuple[torch.Tensor, torch.Tensor]] = []
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
            if lazy_params is not None and (
                kind == "optimizer" or t.untyped_storage().data_ptr() in lazy_params
            ):
                staged = stager.reserve(key, t)
                lazy.append((staged, t.detach()))
            else:
                any_cuda |= t.device.type == "cuda"
                staged = stager.stage(key, t)
            items.append(Item(plan, staged, t.dtype, list(t.shape)))
    stager.forget_except({i.plan.key for i in items})
    ready = lazy_event = None
    if any_cuda:
        ready = torch.cuda.Event()
        ready.record()
    cuda_lazy = [(b, t) for b, t in lazy if t.device.type == "cuda"]
    if cuda_lazy:
        stream = stager.copy_stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the optimizer step that produced them
        with torch.cuda.stream(stream):
            for buf, live in cuda_lazy:
                buf.copy_(live, non_blocking=True)
        lazy_event = torch.cuda.Event()
        lazy_event.record(stream)
    snap = Snapshot(step, reason, score, trees, items, meta, ready=ready, dropped=dropped, lazy=lazy)
    snap.lazy_event = lazy_event
    if not lazy:
        snap.copied.set()
    return snap
