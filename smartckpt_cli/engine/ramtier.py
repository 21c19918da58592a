"""The RAM tier in the training process: staging buffers in shared memory that outlive it.

Under ``smartckpt run`` (which owns the RAM area and says where it is in ``SMARTCKPT_RAM_AREA``;
the format is ``store/ramarea.py``'s) the manager's staging buffers are views into a slot file
of this rank's folder in a tmpfs, so the copy a snapshot makes anyway *is* the RAM tier's copy:
one copy of the state beyond training. With ``ram_slots`` 2, two slot files take turns and the
previous RAM snapshot stays whole while the next is copied (a second copy of the state). Order
of calls (the manager's):

1. :meth:`RamTier.open` in the manager's ``__init__`` (None outside ``smartckpt run``, or when
   the run has the tier off);
2. :meth:`plan` at the first step, with the staging specs (when the optimizer's moments exist):
   the slot(s) sized and allocated within the budget, or one line and the tier stands down
   (staging goes back to private memory);
3. per snapshot, training thread: :meth:`begin` hands the stager the buffers of the slot to
   write (locked for writing; with one slot its record withdrawn first), or None (a slot being
   read: the snapshot goes to private buffers, freed again by the next snapshot into the slot;
   the RAM tier skips it);
4. save thread, once the snapshot's copies are done: :meth:`commit` hashes every chunk, checks
   the weights are finite and writes the record (its content: ``engine/ramrecord.py``): the RAM
   snapshot exists; :meth:`end` unlocks;
5. :meth:`load` on restore (training thread): the record's slot re-hashed, every chunk, then
   read in place (no decode); ``None`` with one line naming what failed, and the restore goes on
   to the disk.

Cadence: ``ram_every`` seconds, or (default) as often as :data:`RAM_SHARE` of the training time
allows for what a RAM snapshot costs (:meth:`interval`), never more often than :data:`RAM_FLOOR`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from smartckpt_cli.config import Settings, parse_size
from smartckpt_cli.engine.hostmem import pin_region, unpin_region
from smartckpt_cli.engine.ramrecord import copy_out, loaded_from, new_record, record_entries, snapshot_health
from smartckpt_cli.engine.snapshot import Snapshot, Spec
from smartckpt_cli.state.apply import Loaded
from smartckpt_cli.state.precision import tensor_bytes
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.names import RAM_SLOTS, ram_rank_dir

__all__ = ["ENV_AREA", "ENV_BYTES", "RAM_FLOOR", "RAM_SHARE", "RamTier"]

logger = logging.getLogger(__name__)

ENV_AREA = ramarea.ENV_AREA
ENV_BYTES = ramarea.ENV_BYTES
RAM_SHARE = 0.02  # the share of training time RAM snapshots may cost by default
RAM_FLOOR = 1.0  # seconds: never more often than this by default
_MARGIN = 64 << 20  # left free in the tmpfs and the host's memory beyond the slots


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


class RamTier:
    """This rank's slot(s) and their record (module docstring)."""

    def __init__(self, rank_dir: Path, budget: int, settings: Settings, store_id: str, rank: int, world: int):
        self.dir, self.budget, self.store_id = rank_dir, budget, store_id
        self.rank, self.world = rank, world
        self.every = settings.ram_every
        self.nslots = settings.ram_slots or 1  # 0: as memory_budget allows (plan's ``slots``)
        self.chunk_bytes = settings.chunk_mb << 20
        # a restore's copy out of the slot is memory-bound: no more threads than this rank's
        # share of the cores (the node's ranks restore at the same time)
        self.workers = max(1, min(settings.n_workers, (os.cpu_count() or 1) // ramarea.local_ranks()))
        # Set once the tier stands down (a one-way switch the loop, the save thread, the preparing
        # thread and the encode pool may all throw): an Event, read by all of them.
        self._down = threading.Event()
        self.slots: list[ramarea.Slot | None] = [None, None]
        self.buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self.offsets: dict[str, int] = {}
        self.specs: list[Spec] = []
        self.size = 0
        self._layout = 0  # bumped by every plan; a slot mapped for an older one is remapped
        self._mapped = [-1, -1]
        self._pinned: list[int | None] = [None, None]  # a slot's address registered with CUDA
        self._said_unpinned = False
        self._prep: threading.Thread | None = None
        self.committed: int | None = None  # the slot the record names
        # seconds a RAM snapshot costs (loop wait + copies and hashes), smoothed: written by the
        # save thread, read by the loop's cadence (interval), under _cost_lock
        self._cost = 0.0
        self._cost_lock = threading.Lock()
        self.snapshots = 0
        self.last: dict[str, Any] | None = None  # the newest record this process wrote or read
        # The record each slot was last committed with by this process: an entry a snapshot
        # references (unchanged, engine/unchanged.py) keeps its place and hashes from it.
        self.records: dict[int, dict[str, Any]] = {}
        # The resume check's values of the step after a snapshot not recorded yet (a manager's
        # loop computes them while the save thread still writes that snapshot): note_next_step.
        self._record_lock = threading.Lock()  # the record is written by the save thread and the pool
        self._next: Any = None
        try:
            rec = ramarea.read_record(rank_dir)
        except (ValueError, OSError):
            rec = None
        if rec is not None:
            self.committed = RAM_SLOTS.index(rec["slot"])

    @classmethod
    def open(cls, settings: Settings, store_id: str, rank: int, world: int) -> RamTier | None:
        area = os.environ.get(ENV_AREA)
        if not area or not settings.ram:
            return None
        rank_dir = Path(area) / ram_rank_dir(rank)
        try:
            rank_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            logger.warning(
                "smartckpt: RAM tier off: cannot use %s (%s); restarts restore from disk", rank_dir, err
            )
            return None
        budget = (
            parse_size(settings.ram_budget) if settings.ram_budget else int(os.environ.get(ENV_BYTES) or 0)
        )
        if budget <= 0:
            budget = ramarea.default_budget()
        return cls(rank_dir, budget, settings, store_id, rank, world)

    # ------------------------------------------------------------------ slots

    def plan(self, specs: list[Spec], nice: int = 10, count: int | None = None) -> bool:
        """Size the slots for ``specs`` (module docstring, 2): checked here, allocated by a
        low-priority background thread (as the stager prepares its buffers); False when the tier
        stood down. A snapshot before the slots are ready goes to private buffers. ``count``:
        how many the memory budget allows (engine/budget.py), 1 or 2; None: as before."""
        if not self.active:
            return False
        if count is not None and count != self.nslots:
            self.wait_ready()
            self.nslots, self.size = count, 0  # laid out again below
        sizes = [(sp.key, _nbytes(sp.shape, sp.dtype)) for sp in specs]
        offsets, size = ramarea.layout(sizes)
        if offsets == self.offsets and size == self.size:
            return True
        mine = RAM_SLOTS[: self.nslots]
        have = sum(os.stat(self.dir / n).st_size for n in mine if (self.dir / n).exists())
        need = self.nslots * size
        free = ramarea.room(self.dir)
        avail = psutil.virtual_memory().available
        why = None
        if need > self.budget:
            why = f"that is above ram_budget ({_gb(self.budget)} per rank)"
        elif need - have + _MARGIN > free:
            why = f"{self.dir.parent.parent} has {_gb(free)} free"
        elif need - have + _MARGIN > avail:
            why = f"the host has {_gb(avail)} of memory available"
        if why is not None:
            slots = f"2 slots of {_gb(size)} = {_gb(need)}" if self.nslots == 2 else f"{_gb(size)}"
            self.stand_down(
                f"a RAM snapshot needs {slots}, and {why}: the RAM tier stands down, restarts restore from disk"
            )
            return False
        self.wait_ready()
        self.offsets, self.size, self.specs = offsets, size, list(specs)
        self._layout += 1
        self.records = {}  # laid out anew: nothing in a slot is known any more
        todo = [i for i in range(self.nslots) if i != self.committed or self._fits(i)]

        def run() -> None:
            if nice:
                with contextlib.suppress(OSError, AttributeError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            for i in todo:
                try:
                    if self._ensure(i, touch=True):
                        self.end(i)
                except OSError as err:  # ENOSPC from posix_fallocate: never a SIGBUS later
                    self.stand_down(
                        f"{self.dir.parent.parent} refused {_gb(size)} for a RAM slot ({err.strerror or err}): "
                        "the RAM tier stands down, restarts restore from disk"
                    )
                    return

        self._prep = threading.Thread(target=run, name="smartckpt-ram", daemon=True)
        self._prep.start()
        return True

    def wait_ready(self) -> None:
        prep = self._prep
        if prep is not None:
            prep.join()

    def _fits(self, i: int) -> bool:
        """Whether slot ``i``'s file already has the size of the current layout (mapping it
        then changes nothing in it, even while it is read)."""
        path = self.dir / RAM_SLOTS[i]
        return path.exists() and path.stat().st_size == self.size

    def _ensure(self, i: int, *, touch: bool = False) -> bool:
        """Slot ``i`` mapped for the current layout and locked for writing; False while somebody
        reads it (then nothing about it changed). ``touch`` (the preparing thread): every page of
        a new mapping is faulted in now, writable, so the first snapshot into it copies at the
        speed of the later ones instead of faulting 4 KB at a time on the training thread."""
        slot = self.slots[i]
        if slot is not None and self._mapped[i] == self._layout:
            return slot.try_lock()
        if slot is not None:
            self._unmap(i)
        slot = ramarea.Slot(self.dir / RAM_SLOTS[i], 0)  # opened, not yet sized
        if not slot.try_lock():
            slot.close()
            return False
        try:
            slot.resize(self.size)  # under the exclusive lock: nobody maps it meanwhile
        except BaseException:
            slot.close()
            raise
        base = torch.frombuffer(slot.map, dtype=torch.uint8, count=self.size)
        if touch:
            _fault_in(slot.map)
        if any(sp.pin for sp in self.specs):  # the state is on a GPU: copies at pinned speed
            if pin_region(base.data_ptr(), self.size):
                self._pinned[i] = base.data_ptr()
            elif not self._said_unpinned:
                self._said_unpinned = True
                logger.warning(
                    "smartckpt: the RAM tier's slot could not be pinned (cudaHostRegister failed: "
                    "ulimit -l?); device-to-host copies into it run at pageable speed"
                )
        self.buffers[i] = {
            sp.key: base[self.offsets[sp.key] : self.offsets[sp.key] + _nbytes(sp.shape, sp.dtype)]
            .view(sp.dtype)
            .view(sp.shape)
            for sp in self.specs
        }
        self.slots[i], self._mapped[i] = slot, self._layout
        if i == self.committed:
            self.committed = None  # resized: whatever it held is gone
        return True

    def begin(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The slot for the next snapshot and its buffers, locked for writing; None when the
        tier is off or that slot is being read. Slots still being prepared are waited for: a
        snapshot staged elsewhere would hold a private copy of the state beside them.

        With one slot (``ram_slots`` 1) the slot is the one the record names: the record is
        withdrawn first (``ramarea.drop_record``), so a crash during the copy restores from
        disk; the entries the snapshot references (unchanged) stay in place meanwhile."""
        if not self.active or self.size == 0:
            return None
        self.wait_ready()
        if not self.active:  # the preparation found no room
            return None
        i = (1 if self.committed == 0 else 0) if self.nslots == 2 else 0
        try:
            if not self._ensure(i):
                return None
        except OSError as err:
            self.stand_down(
                f"{self.dir.parent.parent} refused {_gb(self.size)} for a RAM slot ({err.strerror or err}): "
                "the RAM tier stands down, restarts restore from disk"
            )
            return None
        if i == self.committed:
            with self._record_lock:  # note_next_step must not write it back meanwhile
                ramarea.drop_record(self.dir)
                self.committed = self.last = None
                self._next = None
        return i, self.buffers[i]

    def end(self, i: int) -> None:
        slot = self.slots[i]
        if slot is not None:
            slot.unlock()

    def commit(self, snap: Snapshot, i: int, pool: Executor) -> None:
        """Hash and record the snapshot in slot ``i`` (its copies are done): it becomes the RAM
        snapshot. Runs on the save thread; the hashing fans out to ``pool``."""
        t0 = time.perf_counter()
        items = snap.staged
        hashes = list(
            pool.map(lambda it: ramarea.chunk_hashes(tensor_bytes(it.tensor), self.chunk_bytes), items)
        )
        snap.ram_hashes = {it.plan.key: h for it, h in zip(items, hashes, strict=True)}  # for the writer
        health = snapshot_health(snap, pool)
        entries = record_entries(snap, hashes, self.offsets, self.records.get(i, {}).get("entries", {}), i)
        record = new_record(
            snap,
            entries,
            store_id=self.store_id,
            slot=i,
            slot_size=self.size,
            chunk_bytes=self.chunk_bytes,
            health=health,
            rank=self.rank,
            world=self.world,
        )
        with self._record_lock:
            pending, self._next = self._next, None
            if pending is not None and pending.step == snap.step + 1 and "next_step" not in snap.meta:
                record["meta"] = {**snap.meta, "next_step": {"step": pending.step, **pending.read()}}
            ramarea.write_record(self.dir, record)  # the RAM snapshot's commit point
            self.committed, self.last = i, record
            self.records[i] = record
        self.snapshots += 1
        took = snap.blocking_seconds + snap.guard_seconds + (time.perf_counter() - t0)
        with self._cost_lock:
            self._cost = took if self._cost == 0.0 else 0.7 * self._cost + 0.3 * took

    @property
    def layout(self) -> int:
        """Bumped whenever the slots are laid out anew (what was in them is no longer there)."""
        return self._layout

    def note_next_step(self, values: Any) -> None:
        """Any thread: the resume check's values of the step after this rank's RAM snapshot
        (``values``: :class:`~smartckpt_cli.engine.resumecheck.Values`), written into its record
        when the snapshot is that step's predecessor, so a restore from RAM (or its flash persist)
        is checked like one from disk. A manager's own loop computes them only after the save."""
        with self._record_lock:
            last = self.last
            if not self.active:
                return
            if last is None or int(last["step"]) != values.step - 1:
                self._next = values  # its snapshot is still being written: it takes them
                return
            meta = dict(last.get("meta") or {})
            if "next_step" in meta:
                return
            meta["next_step"] = {"step": values.step, **values.read()}
            record = {k: v for k, v in last.items() if k not in ("format", "version")}
            record["meta"] = meta
            try:
                ramarea.write_record(self.dir, record)
            except OSError as err:  # a full tmpfs: the record as it was stays, without them
                self.stand_down(
                    f"the RAM snapshot of step {last['step']}: its record cannot be rewritten "
                    f"({type(err).__name__}: {err}): the RAM tier stands down, restarts restore from disk"
                )
                return
            self.last = record
            if self.committed is not None:
                self.records[self.committed] = record

    @property
    def active(self) -> bool:
        """Whether the tier still takes snapshots (False for good once it stood down)."""
        return not self._down.is_set()

    @property
    def cost(self) -> float:
        with self._cost_lock:
            return self._cost

    def interval(self) -> float:
        """Seconds between RAM snapshots (module docstring)."""
        if self.every is not None:
            return self.every
        return max(RAM_FLOOR, self.cost / RAM_SHARE)

    def stand_down(self, why: str | None = None) -> None:
        """Off for good, with ``why`` said once (None: said elsewhere, as the memory budget's
        line does)."""
        if why is not None and self.active:
            logger.warning("smartckpt: %s", why)
        self._down.set()

    def _unmap(self, i: int) -> None:
        slot = self.slots[i]
        self.buffers[i] = {}
        pinned, self._pinned[i] = self._pinned[i], None
        if pinned is not None:  # unpinned before the mapping goes
            unpin_region(pinned)
        if slot is not None:
            slot.close()
        self.slots[i] = None

    def close(self) -> None:
        """Unmap the slots (the files stay: the RAM area is smartckpt run's)."""
        self.wait_ready()
        for i, slot in enumerate(self.slots):
            if slot is not None:
                self._unmap(i)

    # ------------------------------------------------------------------ restore

    def candidate(self, *, include_unhealthy: bool = False) -> dict[str, Any] | None:
        """This rank's RAM record when it may serve a restore (same store, healthy), else None;
        a damaged record is one line, then None."""
        try:
            rec = ramarea.read_record(self.dir)
        except (ValueError, OSError) as err:
            logger.warning("smartckpt: the RAM snapshot cannot be used (%s); restoring from disk", err)
            return None
        if rec is None or rec["store_id"] != self.store_id:
            return None
        if rec.get("world_size") != self.world or rec.get("rank") != self.rank:
            # another world size: each rank's snapshot is its old part; the disk reshards
            logger.warning(
                "smartckpt: the RAM snapshot of step %d was taken by rank %s of %s; restoring from disk",
                rec["step"],
                rec.get("rank"),
                rec.get("world_size"),
            )
            return None
        if rec.get("health") != "ok" and not include_unhealthy:
            logger.warning(
                "smartckpt: the RAM snapshot of step %d is %s; restoring from disk",
                rec["step"],
                rec.get("health"),
            )
            return None
        return rec

    def load(self, rec: dict[str, Any]) -> Loaded | None:
        """``rec``'s snapshot as tensors of their own memory, every chunk verified as it is copied
        out (no decode); None with one line when a chunk fails its hash.

        Copied, not views of the slot: the slot is refilled by later snapshots, and an
        optimizer's ``load_state_dict`` keeps the tensors it is given (same dtype and device)."""
        tensors, bad = copy_out(self.dir, rec, self.workers)
        if bad is not None:
            logger.warning(
                "smartckpt: the RAM snapshot of step %d is damaged: %s; restoring from disk",
                rec["step"],
                bad,
            )
            return None
        self.last = rec
        return loaded_from(rec, tensors)


def _fault_in(buf: Any) -> None:
    """Write every page of a shared mapping with its own byte (content unchanged): each page is
    then mapped and writable in this process (a read alone would leave the write fault). The
    bytes go through a copy: NumPy skips ``a[:] = a`` as a no-op, which left every page to the
    first snapshot's copy (0.3 GB: 94 ms against 35-50 ms later)."""
    pages = np.frombuffer(buf, dtype=np.uint8)[:: ramarea.PAGE]
    pages[:] = pages.copy()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
