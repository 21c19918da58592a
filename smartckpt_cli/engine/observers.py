"""What the manager tells the tiers beside the local store, and what it asks of them.

:class:`CommitObserver` listens to the life of a store: the manager keeps a list of them and
calls, in this order (training thread unless said otherwise):

1. ``on_start(store_id)`` once, at the end of the manager's ``__init__``;
2. ``on_commit(info)`` after each commit line, on the background save thread (it must return at
   once: wake a thread of its own, never write or upload here; an exception is logged, the
   commit stands);
3. ``on_preempt()`` after the blocking save a preemption signal took, before the signal is
   handed on (the node may not come back: get what matters off it, bounded in time);
4. ``on_close()`` in ``close()``, after the last save was waited for.

:class:`CheckpointSource` is where a restore looks: ``adopted_store_id`` is asked once, before
the local journal exists; ``order(state, ...)`` lists the candidates (each with a ``.record``)
newest first, and ``fetch(candidate, damaged)`` downloads what the local store lacks of one (a
candidate only the remote holds, or a local copy that failed with ``damaged``), after which the
manager reads it from the local store again. :class:`LocalSource` is the local store alone. The remote tier (:class:`smartckpt_cli.remote.tier.RemoteTier`) is both, structurally;
:func:`open_tiers` builds it when ``remote`` is set, and the manager talks to it only through
these two protocols.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from smartckpt_cli.config import Settings
from smartckpt_cli.engine import heartbeat
from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.remote.fetch import Candidate
from smartckpt_cli.store.checkpoints import candidates
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import JournalState

__all__ = ["CheckpointSource", "CommitObserver", "LocalSource", "open_tiers"]


@runtime_checkable
class CommitObserver(Protocol):
    """Told of a store's start, commits, preemption and close (module docstring)."""

    def on_start(self, store_id: str) -> None: ...

    def on_commit(self, info: Any) -> None: ...

    def on_preempt(self) -> None: ...

    def on_close(self) -> None: ...


@runtime_checkable
class CheckpointSource(Protocol):
    """Where a restore looks, in which order (module docstring)."""

    adopted_store_id: str | None

    def order(self, state: JournalState, *, include_unhealthy: bool) -> list[Candidate]: ...

    def fetch(self, cand: Candidate, damaged: CheckpointCorrupt | None = None) -> None: ...


class LocalSource:
    """The local store alone: its live checkpoints, newest first."""

    adopted_store_id: str | None = None

    def order(self, state: JournalState, *, include_unhealthy: bool) -> list[Candidate]:
        return [
            Candidate(r, "local", False)
            for r in candidates(state.records, include_unhealthy=include_unhealthy)
        ]

    def fetch(self, cand: Candidate, damaged: CheckpointCorrupt | None = None) -> None:
        """Nothing to fetch from: a local candidate that fails stays failed."""
        raise damaged or CheckpointCorrupt(f"step {cand.record.step}: no remote tier to fetch it from")


def open_tiers(
    settings: Settings, store: StoreDir, rank: int = 0, world: int = 1
) -> tuple[CheckpointSource, list[CommitObserver]]:
    """Where restores look and who hears of commits: the local store alone, or with
    ``settings.remote`` the remote tier, both. Called by the writing process (rank 0, before the
    journal exists: it may adopt the remote's store id), and with several ranks by every other
    rank after it: each rank uploads and fetches its own part (remote/parts.py)."""
    if not settings.remote:
        return LocalSource(), []
    from smartckpt_cli.remote.tier import RemoteTier

    def pause(seconds: float) -> None:
        # waiting for the remote at start: smartckpt run shows it, and does not count it as a hang
        with heartbeat.heartbeat_state("WAITING"):
            time.sleep(seconds)

    tier = RemoteTier.open(settings, store, rank, world, pause)
    return tier, [tier]
