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
being written. CUDA tensors go to pinned host buffers (engine/hostmem.py) with non-blocking copies and events;
without CUDA it is a plain copy into preallocated buffers.

**Prepared off the critical path.** Allocating the staging memory is what made the first save
slow: 2.4 s of pinned allocation for 4.8 GB on an H200 host, 1.4 s of first-touch page faults
for 1.2 GB on CPU. :meth:`Stager.prepare` (the manager calls it at the first step after
``register``/``restore``, when the optimizer's moments exist) allocates every entry's buffer in a
low-priority background thread and touches its pages; the first save then finds them ready (or
waits for the thread, never allocating twice). Pinned memory is taken by registering the
buffer's own pages (``cudaHostRegister``), not from PyTorch's pinned allocator, which rounds each
block up to a power of two (a 180 MB tensor would hold 256 MB): staging stays the size of the
state. Where registering fails (``ulimit -l``, no CUDA runtime) it is PyTorch's pinned allocator,
and where that fails too, pageable memory (copies are then synchronous; the save still works).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from smartckpt_cli.engine.hostmem import host_buffer
from smartckpt_cli.engine.unchanged import Unchanged
from smartckpt_cli.state.optstate import moment_keys, param_shapes
from smartckpt_cli.state.tiers import EntryPlan, TierRule, classify
from smartckpt_cli.state.tree import flatten

__all__ = ["Item", "Snapshot", "Spec", "Stager", "staging_specs", "take_snapshot"]

logger = logging.getLogger(__name__)


@dataclass
class Item:
    plan: EntryPlan
    tensor: torch.Tensor | None  # the staged copy: CPU, contiguous; None: referenced (``ref``)
    dtype: torch.dtype
    shape: list[int]
    # Unchanged since the last committed checkpoint (engine/unchanged.py): its manifest entry
    # there, used as it is (nothing copied, hashed or written); None: staged.
    ref: dict[str, Any] | None = None
    # A save in pieces (engine/pager.py): the live tensor, copied piece by piece by the writer;
    # ``guarded``: an optimizer's pre-hook keeps it from changing until then; ``part``: this item
    # is the bytes of the whole tensor from this offset on (its ``tensor`` flat, ``shape`` whole).
    live: torch.Tensor | None = None
    guarded: bool = False
    part: int | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


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
    ram_slot: int | None = None  # the RAM tier's slot it was copied into (engine/ramtier.py)
    # Called by the writer right before the manifest is written (save thread): the resume check
    # adds what the step after the save computed, when it came in time (resumecheck.py).
    before_manifest: Any = None
    # Every tensor's fingerprint at this snapshot (engine/unchanged.py), for what commits next.
    fingerprints: dict[str, Any] = field(default_factory=dict)
    # The rotation's share of referenced bytes to hash again: (key, the bytes, their raw hash).
    verify: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)
    # The RAM tier's hashes of the staged bytes ([length, raw hash] per chunk, by key), set when
    # it recorded this snapshot: the writer reuses them (each chunk hashed once per save).
    ram_hashes: dict[str, list[Any]] = field(default_factory=dict)
    # A save in pieces (engine/pager.py): the writer copies the deferred items through it;
    # ``early`` is set once the items no optimizer guards are copied (the save call waits for it).
    pager: Any = None
    early: threading.Event = field(default_factory=threading.Event)

    @property
    def staged(self) -> list[Item]:
        """The items copied (or, in pieces, to be copied): all but the referenced ones."""
        return [i for i in self.items if i.ref is None]

    @property
    def guards(self) -> bool:
        """Whether an optimizer step must wait for copies still to come (lazy or in pieces)."""
        return bool(self.lazy) or (self.pager is not None and any(i.guarded for i in self.items))

    def release(self) -> None:
        """The save thread is done with the live tensors (written, or failed): nothing waits."""
        self.early.set()
        self.copied.set()

    def finish_copies(self) -> None:
        """Background side of the lazy path: copy what the snapshot deferred (CPU), then let the
        optimizer step go on. Always releases the guard, even if a copy fails. Once only: after
        the guard is released the live tensors move on (the RAM tier's commit and the writer
        both wait for the copies; a second copy would take the next step's values). A save in
        pieces copies in the writer (engine/pager.py): nothing here."""
        if self.copied.is_set() or self.pager is not None:
            return
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


@dataclass(frozen=True)
class Spec:
    """One staging buffer to prepare."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    pin: bool


class Stager:
    """Reusable host buffers, one per state entry; :meth:`prepare` makes them in the background."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # The RAM tier's slot for this snapshot (engine/ramtier.py): its buffers are used first;
        # an entry it has no fitting buffer for goes to a private one and marks the snapshot
        # ``missed`` (the RAM tier does not commit it).
        self.slot: dict[str, torch.Tensor] | None = None
        self.missed = False
        self._pin = torch.cuda.is_available()
        self._prep: threading.Thread | None = None
        self.prepared_seconds = 0.0  # how long the background preparation took

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def prepare(self, specs: list[Spec], nice: int = 10) -> None:
        """Allocate (and touch, or pin) the buffers of ``specs`` in a background thread."""
        if self._prep is not None and self._prep.is_alive():
            return
        todo = [sp for sp in specs if not self._fits(self._buffers.get(sp.key), sp.shape, sp.dtype)]
        if not todo:
            return

        def run() -> None:
            t0 = time.perf_counter()
            if nice:
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                except (OSError, AttributeError):
                    pass
            try:
                for sp in todo:
                    buf = host_buffer(sp.shape, sp.dtype, sp.pin and self._pin)
                    if buf.numel() and not buf.is_pinned():
                        buf.zero_()  # fault the pages in now, not in the first save's copy
                    self._buffers[sp.key] = buf
            except Exception as err:  # the save allocates what is missing, as before
                logger.warning("preparing the staging buffers failed: %s", err)
            self.prepared_seconds = time.perf_counter() - t0

        self._prep = threading.Thread(target=run, name="smartckpt-staging", daemon=True)
        self._prep.start()

    def ready(self) -> None:
        """Wait for the background preparation, if one runs (the snapshot never allocates a
        buffer the thread is about to make: no entry is held twice)."""
        prep = self._prep
        if prep is not None:
            prep.join()

    @staticmethod
    def _fits(buf: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> bool:
        return buf is not None and buf.shape == shape and buf.dtype == dtype

    def use(self, slot: dict[str, torch.Tensor] | None) -> None:
        """Stage the next snapshot into ``slot``'s buffers (None: private buffers only)."""
        self.slot, self.missed = slot, False

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if self.slot is not None:
            shared = self.slot.get(key)
            if self._fits(shared, t.shape, t.dtype):
                assert shared is not None
                return shared
            self.missed = True
        buf = self._buffers.get(key)
        if not self._fits(buf, t.shape, t.dtype):
            buf = host_buffer(t.shape, t.dtype, self._pin and t.device.type == "cuda")
            self._buffers[key] = buf
        assert buf is not None
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


def staging_specs(
    objects: dict[str, tuple[str, Any]], *, precision: str, rules: tuple[TierRule, ...]
) -> list[Spec]:
    """The buffers a snapshot of ``objects`` will stage into (what :func:`take_snapshot` stores)."""
    specs = []
    for name, (kind, obj) in objects.items():
        _, tensors = flatten(obj.state_dict(), name)
        for key, t in tensors.items():
            plan = classify(
                key, kind, numel=t.numel(), floating=t.is_floating_point(), precision=precision, rules=rules
            )
            if plan.stored:
                specs.append(Spec(key, t.shape, t.dtype, t.device.type == "cuda"))
    return specs


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
    trained: set[int] | None = None,
    unchanged: Unchanged | None = None,
    slot: Any = None,
    ram_only: bool = False,
    pager: Any = None,
) -> Snapshot:
    """Copy every registered object's state. ``objects``: name -> (kind, object with state_dict).

    ``lazy_params``: the storage pointers of parameters guarded by an optimizer pre-hook; given,
    those and the optimizers' state are copied lazily (see module docstring), else all eagerly.
    ``unchanged``: what is proven unchanged since the last committed checkpoint is referenced,
    not copied (engine/unchanged.py; ``trained``: storage pointers of the parameters optimizers
    update, never referenced; ``slot``: the RAM slot copied into, ``ram_only``: a RAM snapshot
    alone). ``pager``: a save in pieces (engine/pager.py): nothing is copied here, the writer
    copies the items a piece at a time."""
    stager.ready()
    trees, dropped, found, plans = _plan_entries(objects, precision=precision, rules=rules)
    # Referenced when unchanged: what no optimizer updates (frozen weights, buffers). A trained
    # parameter or an optimizer's state changes at every step, and is never worth the doubt.
    trained = trained if trained is not None else lazy_params or set()
    candidates = {
        key: (kind, t)
        for key, (kind, t) in found.items()
        if kind != "optimizer" and t.untyped_storage().data_ptr() not in trained
    }
    decided = unchanged.decide(candidates, plans, slot, ram_only=ram_only) if unchanged is not None else None
    refs = decided.refs if decided is not None else None
    items, lazy, any_cuda = _items(found, plans, refs, stager=stager, lazy_params=lazy_params, pager=pager)
    # Private buffers are dropped once a snapshot fitted the RAM tier's slot whole (memory stays
    # the slots' alone); else those of entries no longer in the state.
    whole = (stager.slot is not None and not stager.missed) or pager is not None
    stager.forget_except(set() if whole else {i.plan.key for i in items if i.tensor is not None})
    ready, lazy_event = _start_device_copies(stager, lazy, any_cuda)
    snap = Snapshot(step, reason, score, trees, items, meta, ready=ready, dropped=dropped, lazy=lazy)
    snap.lazy_event, snap.pager = lazy_event, pager
    if decided is not None:
        snap.fingerprints = decided.fps
        snap.verify = _verify_bytes(decided.verify, found)
    if not lazy and pager is None:
        snap.copied.set()
    return snap


def _plan_entries(
    objects: dict[str, tuple[str, Any]], *, precision: str, rules: tuple[TierRule, ...]
) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, tuple[str, torch.Tensor]], dict[str, EntryPlan]]:
    """Every object's tree and every tensor's plan: (trees, the keys not stored, the stored
    tensors by key with their object's kind, their plans). An optimizer's tree also records its
    parameters' shapes, and only its moments are classified as moments."""
    trees: dict[str, dict[str, Any]] = {}
    dropped: list[str] = []
    found: dict[str, tuple[str, torch.Tensor]] = {}
    plans: dict[str, EntryPlan] = {}
    for name, (kind, obj) in objects.items():
        sd = obj.state_dict()
        tree, tensors = flatten(sd, name)
        trees[name] = {"kind": kind, "tree": tree}
        moments: set[str] | None = None
        if kind == "optimizer":
            shapes = param_shapes(obj, sd)
            trees[name]["param_shapes"] = shapes  # what restore compares moments against
            moments = moment_keys(name, sd, shapes)
        for key, t in tensors.items():
            plan = classify(
                key,
                kind,
                numel=t.numel(),
                floating=t.is_floating_point() or t.is_complex(),
                precision=precision,
                rules=rules,
                moment=moments is None or key in moments,
            )
            if not plan.stored:
                dropped.append(key)
                continue
            found[key], plans[key] = (kind, t), plan
    return trees, dropped, found, plans


def _items(
    found: dict[str, tuple[str, torch.Tensor]],
    plans: dict[str, EntryPlan],
    refs: dict[str, dict[str, Any]] | None,
    *,
    stager: Stager,
    lazy_params: set[int] | None,
    pager: Any,
) -> tuple[list[Item], list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """One item per stored tensor, in order: referenced (in ``refs``), left live for a save in
    pieces, reserved for a lazy copy, or staged now. Returns the items, the lazy (buffer, live)
    pairs, and whether an eager copy left a device (its event must be recorded)."""
    items: list[Item] = []
    lazy: list[tuple[torch.Tensor, torch.Tensor]] = []
    any_cuda = False
    for key, (kind, t) in found.items():
        plan = plans[key]
        if refs is not None and key in refs:
            items.append(Item(plan, None, t.dtype, list(t.shape), ref=refs[key]))
            continue
        if pager is not None:
            guarded = lazy_params is not None and (
                kind == "optimizer" or t.untyped_storage().data_ptr() in lazy_params
            )
            any_cuda |= t.device.type == "cuda"
            items.append(Item(plan, None, t.dtype, list(t.shape), live=t.detach(), guarded=guarded))
            continue
        if lazy_params is not None and (kind == "optimizer" or t.untyped_storage().data_ptr() in lazy_params):
            staged = stager.reserve(key, t)
            lazy.append((staged, t.detach()))
        else:
            any_cuda |= t.device.type == "cuda"
            staged = stager.stage(key, t)
        items.append(Item(plan, staged, t.dtype, list(t.shape)))
    return items, lazy, any_cuda


def _start_device_copies(
    stager: Stager, lazy: list[tuple[torch.Tensor, torch.Tensor]], any_cuda: bool
) -> tuple[Any, Any]:
    """CUDA only: the event the eager copies complete at (``ready``), and the lazy copies of
    device tensors started on the stager's side stream with the event they complete at."""
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
    return ready, lazy_event


def _verify_bytes(
    jobs: list[tuple[str, int, int, str]], found: dict[str, tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor, str]]:
    """The rotation's bytes of referenced tensors (engine/unchanged.py): read in place on the CPU
    (hashed later, in the background: a frozen tensor does not move under it), copied off a
    device. A non-contiguous tensor is left out (its bytes are not one run)."""
    out = []
    for key, start, length, raw_hash in jobs:
        t = found[key][1].detach()
        if not t.is_contiguous():
            continue
        piece = t.reshape(-1).view(torch.uint8)[start : start + length]
        out.append((key, piece if piece.device.type == "cpu" else piece.cpu(), raw_hash))
    return out
