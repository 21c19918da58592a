"""Multi-rank coordination over torch.distributed (torchrun, DDP, FSDP2).

smartckpt rides on the training's own ``torch.distributed`` world; it invents no transport. It
creates two **gloo** groups of its own, so its messages never interleave with the training's
collectives (which may be NCCL, and run on other threads and streams):

* the *decide* group, used only from the training thread: one small ``all_reduce`` at each
  *decision step* that carries rank 0's save decision and the distance to the next decision step,
  any rank's preemption signal and memory alarm, and the restore agreement. Decision steps are
  spaced so the collective stays under a quarter of a percent of the training time and at most a
  second apart (cadence.py); they land exactly on the steps of a step schedule;
* the *commit* group, used only from the background save thread: the two-phase commit (entry
  digests, then per-rank "durable" verdicts, then rank 0's commit result).

A process group may only be used from one thread at a time in the same order on every rank, which
is why there are two. The pure functions at the bottom decide ownership and names; the
:class:`Comm` object does the collectives and nothing else.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.state.tree import local_tensor
from smartckpt_cli.store.directory import DIR_ID
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.names import part_rel

__all__ = [
    "DIR_ID",
    "Comm",
    "detect",
    "dir_id",
    "dir_leaders",
    "entry_owner",
    "guard_destroy",
    "local_tensor",
    "needs_reshard",
    "part_rel",  # re-exported from store.names
]

logger = logging.getLogger(__name__)

# Long enough for a slow rank's background write, short enough that a dead peer is noticed; a rank
# that dies normally breaks the gloo connection at once (the supervisor restarts the group).
TIMEOUT = datetime.timedelta(seconds=900)


def _launched_multi() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Comm:
    rank: int
    world: int
    decide_group: Any
    commit_group: Any

    # -- training thread ---------------------------------------------------------------
    def decide(
        self,
        save: bool,
        signum: int,
        gap: int = 1,
        urgent: bool = False,
        blocked: bool = False,
        every: int = 0,
    ) -> tuple[bool, int, int, bool, bool, int]:
        """One agreement of every rank at a decision step (coordinator.py): rank 0's save decision,
        the steps to the next decision step (``gap``) and its evaluation spacing (``every``: the
        ranks evaluate at the same steps, so no rank waits for another's evaluation in the
        training's own collectives), the highest preemption signal any rank received, whether
        any rank needs a save at once (memory pressure), and whether any rank cannot take a save
        at this step (zero-code mode without its boundary record)."""
        import torch.distributed as dist

        mine = [int(save), gap, every] if self.rank == 0 else [0, 0, 0]
        t = torch.tensor([mine[0], signum, mine[1], int(urgent), int(blocked), mine[2]], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.decide_group)
        v = t.tolist()
        return bool(v[0]), int(v[1]), max(1, int(v[2])), bool(v[3]), bool(v[4]), int(v[5])

    def broadcast(self, obj: Any, *, commit: bool = False) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.commit_group if commit else self.decide_group)
        return box[0]

    def gather(self, obj: Any, *, commit: bool = False) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.commit_group if commit else self.decide_group)
        return out


def detect(setting: str = "auto", timeout: float | None = None) -> Comm | None:
    """The Comm of a multi-rank run, or None for one process. ``setting``: ``auto`` or ``off``;
    ``timeout``: seconds a rank waits in smartckpt's own collectives (the ``rank_timeout``
    setting; a rank that died breaks them at once, one that hangs is given up on after it)."""
    if setting == "off":
        return None
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if _launched_multi():
            raise ConfigError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before creating the CheckpointManager "
                "(or set distributed: off)"
            )
        return None
    world = dist.get_world_size()
    if world <= 1:
        return None
    # Every rank creates the groups in the same order (a collective call each).
    wait = TIMEOUT if timeout is None else datetime.timedelta(seconds=timeout)
    decide = dist.new_group(backend="gloo", timeout=wait)
    commit = dist.new_group(backend="gloo", timeout=wait)
    return Comm(dist.get_rank(), world, decide, commit)


def dir_id(root: Path) -> str:
    """The identity of the disk holding ``root``: ranks with the same id share their blobs. Created
    once, atomically (link of a complete temporary file), so racing ranks agree."""
    path = root / DIR_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = root / f".{DIR_ID}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(uuid.uuid4().hex[:16] + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


# ---------------------------------------------------------------------- pure decisions


def entry_owner(rank: int, key: str, digests: list[dict[str, str]], dirs: list[str]) -> int:
    """The rank that writes entry ``key`` of ``rank``: the lowest rank on the same disk holding the
    identical entry (same key, same digest). Replicated DDP state is thus written once per disk;
    rank-local state (RNG, shards) by its own rank."""
    mine = digests[rank].get(key)
    for r in range(rank):
        if dirs[r] == dirs[rank] and digests[r].get(key) == mine:
            return r
    return rank


def dir_leaders(dirs: list[str]) -> set[int]:
    """The lowest rank of each disk: the one that collects that disk's garbage."""
    first: dict[str, int] = {}
    for r, d in enumerate(dirs):
        first.setdefault(d, r)
    return set(first.values())


def needs_reshard(record: CheckpointRecord, world: int) -> bool:
    """Whether a checkpoint was written at another world size than ``world`` (its state is then
    read by :mod:`.reshard`)."""
    return record.world_size != world


# ---------------------------------------------------------------------- destroy guard

_managers: weakref.WeakSet[Any] = weakref.WeakSet()
_guard_lock = threading.Lock()
_before: dict[int, Callable[[], None]] = {}


def guard_destroy(manager: Any, before: Callable[[], None] | None = None) -> None:
    """Make ``dist.destroy_process_group`` wait for ``manager``'s in-flight save first: the save
    thread's last collectives need the world that call tears down. ``before``: what to run instead
    of ``manager.close()`` (zero-code mode's final checkpoint, then close)."""
    import torch.distributed as dist

    with _guard_lock:
        _managers.add(manager)
        if before is not None:
            _before[id(manager)] = before
        original: Callable[..., Any] = dist.destroy_process_group
        if getattr(original, "_smartckpt", False):
            return

        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            for m in list(_managers):
                try:
                    _before.pop(id(m), m.close)()
                except Exception as err:  # a failed save is reported by close(); never block teardown
                    logger.warning("smartckpt: closing before destroy_process_group: %s", err)
            return original(*args, **kwargs)

        destroy_process_group._smartckpt = True  # type: ignore[attr-defined]
        dist.destroy_process_group = destroy_process_group
