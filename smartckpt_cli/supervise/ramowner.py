"""``smartckpt run``'s side of the RAM tier: it owns the RAM area. No torch.

Order of calls (the supervisor's)::

    RamOwner.open(settings, run_id, emit)   # before the first attempt: the area made, one line
    env.update(owner.env())                 # each attempt: where the area is, the budget per rank
    owner.persist(store_dir, meta_dir, ...) # after a death, before the restart: flash persist
    owner.close()                           # the run ends: flash persists shipped, the area removed

The area (``<ram_dir>/smartckpt-<run id>/``, default ``/dev/shm``) outlives every training
process of the run, so a restarted process finds the snapshot its predecessor left there; the
format is ``store/ramarea.py``'s, the training process's side ``engine/ramtier.py``. The flash
persist runs here, between the death and the next start, synchronously: the next process starts
once the snapshot is a committed checkpoint of the store (``supervise/flash.py``), so nothing
else appends to the journal meanwhile.

With a remote (``--remote``), a flash-persisted checkpoint must reach it too. When another
attempt follows, its uploader ships it: every round uploads every live local commit the remote
lacks, and rounds run at its start, at each of its commits (the first waits for this one,
``flash.lock``), every 30 s and at its close. When none follows, or the one that did died before
a round saw the checkpoint, :meth:`RamOwner.close` ships it at the end of the run
(``remote/ship.py``: the same uploader, for at most ``remote_close_wait`` seconds), one line
either way.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from smartckpt_cli.config import Settings, parse_size
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.remote.replica import display_url
from smartckpt_cli.remote.ship import ship
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.directory import StoreDir, open_store
from smartckpt_cli.store.names import RAM_RECORD, InvalidName, ram_area
from smartckpt_cli.supervise import flash

__all__ = ["RamOwner"]

Emit = Callable[[str, str], None]
FLASH_NICE = 19  # CPU priority of a flash persist running beside a restarted process
FLASH_DEFER = 30.0  # seconds it waits at most for the restarted process's first step


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class RamOwner:
    """The run's RAM area (module docstring)."""

    def __init__(self, area: Path, budget: int, emit: Emit, settings: Settings | None = None) -> None:
        self.area, self.budget, self.emit = area, budget, emit
        self.settings = settings  # its remote and remote_* settings ship the flash persists
        self._thread: threading.Thread | None = None  # a flash persist running behind
        # (store, manifest) of each checkpoint a flash persist wrote in this run
        self._flashed: list[tuple[StoreDir, str]] = []

    @classmethod
    def open(cls, settings: Settings, run_id: str, emit: Emit) -> RamOwner | None:
        """The area made, or one line and None (the run goes on, restarts restore from disk)."""
        if not settings.ram:
            return None
        base = Path(settings.ram_dir or ramarea.DEFAULT_DIR)
        try:
            area = base / ram_area(run_id)
            area.mkdir(mode=0o700, exist_ok=True)
            free = ramarea.room(area)
        except (OSError, InvalidName) as err:
            emit("warning", f"RAM tier off: cannot use {base} ({err}); restarts restore from disk")
            return None
        budget = parse_size(settings.ram_budget) if settings.ram_budget else ramarea.default_budget()
        every = (
            f"every {settings.ram_every:g} s"
            if settings.ram_every
            else "as often as 2 % of the step time allows"
        )
        emit(
            "info",
            f"RAM tier: {area}, up to {_size(budget)} per rank ({_size(free)} free there), a snapshot {every}",
        )
        return cls(area, budget, emit, settings)

    def env(self) -> dict[str, str]:
        return {ramarea.ENV_AREA: str(self.area), ramarea.ENV_BYTES: str(self.budget)}

    def persist(self, store_dir: Path, meta_dir: str | None, newest_disk: int, *, level: int) -> int | None:
        """Flash persist, at once: the RAM snapshot of the dead attempt into the store when it is
        newer than ``newest_disk`` (one line either way when there was one); the step written,
        or None. For the end of a run (nothing restarts after it)."""
        self.wait()
        got = self._take(store_dir, meta_dir, newest_disk)
        return self._write(got[0], got[1], level) if got is not None else None

    def persist_behind(
        self,
        store_dir: Path,
        meta_dir: str | None,
        newest_disk: int,
        *,
        level: int,
        done: Callable[[int | None], None],
        after: threading.Event | None = None,
    ) -> int | None:
        """Flash persist while the next attempt starts: the snapshot is taken (its slots locked)
        now and written on a thread, under ``flash.lock`` held from now on, so the next training
        process's first commit waits for this one (``engine/ramtier.py``, ``flash_wait``: the
        journal stays in step order). Returns the step being written (None: nothing to write);
        ``done`` gets the step written, or None when it failed (said in one line).

        ``after``: the write starts once it is set (the restarted process did its first step, or
        ended) or after ``FLASH_DEFER`` seconds. Reading 1.2 GB out of shared memory and writing
        it while the restarted process restores the same snapshot and allocates its state made
        that restore and first step 2 s slower on 2 cores (measured: docs/recovery.md); the
        snapshot is safe meanwhile in memory (its slot locked), and on disk the checkpoint before
        it."""
        self.wait()
        got = self._take(store_dir, meta_dir, newest_disk)
        if got is None:
            return None
        try:
            fd = os.open(self.area / ramarea.FLASH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # a full tmpfs (no inode left): written now, before the next process exists
            step = self._write(got[0], got[1], level)
            done(step)
            return step
        fcntl.flock(fd, fcntl.LOCK_EX)  # before the next process exists: it cannot commit first

        def run() -> None:
            try:
                # beside the restarted process: its restore and first step come first, and so do
                # its own background threads (at background_nice): this writes at the lowest
                # priority (measured on 2 cores, at the training's background priority it
                # doubled the first resumed step of a warm restart)
                lower_priority(FLASH_NICE)
                if after is not None:
                    after.wait(FLASH_DEFER)
                done(self._write(got[0], got[1], level, FLASH_NICE))
            finally:
                os.close(fd)  # drops the lock

        self._thread = threading.Thread(target=run, name="smartckpt-flash", daemon=True)
        self._thread.start()
        return got[1].step

    def wait(self) -> None:
        """Until a flash persist running behind is written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _take(
        self, store_dir: Path, meta_dir: str | None, newest_disk: int
    ) -> tuple[StoreDir, flash.Held] | None:
        try:
            store = open_store(store_dir, meta_dir=meta_dir, create=False)
            store_id = store.journal.read().store_id
        except (SmartckptError, OSError, ValueError) as err:
            if any(self.area.glob("rank*/" + RAM_RECORD)):
                self.emit(
                    "warning",
                    f"flash persist: the store cannot be opened ({err}); the RAM snapshot stays in RAM",
                )
            return None
        held = flash.take(self.area, store_id, newest_disk)
        if held is None:
            return None
        if isinstance(held, str):
            self.emit("warning", f"flash persist: {held}")
            return None
        return store, held

    def _write(self, store: StoreDir, held: flash.Held, level: int, nice: int = 0) -> int | None:
        try:
            step, manifest, seconds = flash.flash_persist(store, held, level=level, nice=nice)
        except (flash.FlashError, OSError, SmartckptError) as err:
            self.emit("warning", f"flash persist of the RAM snapshot of step {held.step} failed: {err}")
            return None
        finally:
            held.release()
        self._flashed.append((store, manifest))
        self.emit(
            "info",
            f"flash persist: the RAM snapshot of step {step} is a checkpoint of the store now ({manifest}, {seconds:.2f} s)",
        )
        return step

    def discard(self) -> None:
        """After a rollback: no restart may restore the RAM snapshot (it holds the state that
        kept crashing); the records go, the slots stay for the next snapshots."""
        for rec in self.area.glob("rank*/" + RAM_RECORD):
            with contextlib.suppress(OSError):
                rec.unlink()

    def close(self) -> None:
        """The run is over: the checkpoints flash persists wrote go to the remote when they are
        not there yet (module docstring), then the area goes (it is memory)."""
        self.wait()
        try:
            self.ship()
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.area)

    def ship(self) -> None:
        """The live checkpoints that flash persists wrote in this run, onto the remote (when
        there is one) if no training process's uploader put them there; one line when it ran."""
        s = self.settings
        if not self._flashed or s is None or not s.remote:
            return
        store = self._flashed[-1][0]
        try:
            state = store.journal.read()
        except (SmartckptError, OSError, ValueError) as err:
            self.emit(
                "warning", f"flash persist: not shipped to the remote: the journal cannot be read ({err})"
            )
            return
        wrote = {m for _, m in self._flashed}
        # pruned or rolled back since: nothing to ship (a newer checkpoint holds the work, or none may)
        recs = [r for r in state.live() if r.manifest in wrote]
        if not recs or state.store_id is None:
            return
        newest = max(recs, key=lambda r: r.position)
        got = ship(
            s,
            store,
            state.store_id,
            {r.id for r in recs},
            world=newest.world_size,
            timeout=s.remote_close_wait,
        )
        url = display_url(s.remote)
        steps = ", ".join(str(r.step) for r in recs if r.id in got.missing)
        if got.missing:
            why = got.error or f"not uploaded within remote_close_wait ({s.remote_close_wait:g} s)"
            self.emit(
                "warning",
                f"flash persist: step {steps} is not on the remote {url} ({why}); it is a checkpoint "
                f"of {store.root} only, and the next run on this store uploads it",
            )
        elif got.uploaded:
            self.emit(
                "info",
                f"flash persist: step {', '.join(str(r.step) for r in recs)} is on the remote {url} now "
                f"({got.seconds:.1f} s)",
            )
