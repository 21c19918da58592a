"""``smartckpt prune``: keep the newest N checkpoints, remove the rest and unreferenced blobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smartckpt_cli.cli._shared import MetaDirOpt, RemoteOpt, StoreArg, human, progress_bar, say

if TYPE_CHECKING:
    from smartckpt_cli.ops.prune import PruneResult
    from smartckpt_cli.remote.check import PrunePlan as RemotePlan

__all__ = ["prune"]


def prune(
    directory: StoreArg,
    keep: Annotated[
        int, typer.Option("--keep", help="Live checkpoints to keep (at least 1).", show_default=False)
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be removed; remove nothing.")
    ] = False,
    wait: Annotated[
        float, typer.Option("--wait", min=0, help="Seconds to wait for a save in flight to commit.")
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    meta_dir: MetaDirOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Remove old checkpoints and unreferenced blobs, never the newest verified one.

    Keeps the newest --keep live checkpoints and removes the others, then every blob no
    remaining checkpoint references.

    The newest checkpoint that verifies is always kept, whatever --keep says (it is verified
    first). Rolled-back checkpoints are left alone (a rollback can be undone). The prune is
    recorded in the journal before anything is removed. Safe while a training run writes to the
    store: prune waits for a save in flight to commit and holds the next one back until done.

    \b
    Examples:
      smartckpt prune ./checkpoints --keep 3 --dry-run
      smartckpt prune ./checkpoints --keep 3
      smartckpt prune ./checkpoints --keep 3 --remote s3://bucket/run1

    With --remote, --keep is applied to the remote copy too (a prune object first, then the
    manifests and the blobs no kept checkpoint references). Refused while a run's upload round
    is in progress (try again); the running job re-lists the remote afterwards. A URL
    (s3://bucket/run1) prunes that replica alone by the same rule, under a lease in it (locks/).

    \b
    Exit codes:
      0  pruned (or nothing to prune)
      1  no checkpoint verifies, the journal is damaged or a manifest
         unreadable, a save held the lock past --wait (nothing removed),
         the remote is unreachable or an upload is in progress
      2  bad input: not a store, --keep below 1
    """
    from smartckpt_cli.ops.catalog import active_writer
    from smartckpt_cli.ops.prune import carry_out
    from smartckpt_cli.store.directory import open_store
    from smartckpt_cli.store.storage import is_url

    if is_url(directory):
        return _prune_url(directory, keep, dry_run, as_json)
    store = open_store(Path(directory), meta_dir)
    writer = active_writer(store)
    with progress_bar("verifying the newest checkpoint") as progress:
        result = carry_out(store, keep, dry_run=dry_run, lock_timeout=wait, progress=progress)
    remote_plan = _prune_remote(store, remote, keep, dry_run) if remote is not None else None
    if as_json:
        typer.echo(json.dumps(_result_json(result, writer, remote_plan), indent=2))
        return
    _say_result(result, keep, writer, remote_plan, dry_run)


def _prune_url(url: str, keep: int, dry_run: bool, as_json: bool) -> None:
    """--keep on a replica named by its URL (remote/check.prune_remote, the rule ``--remote``
    applies), under a ``prune`` lease: refused while an upload holds one (store/leases.py)."""
    from smartckpt_cli.errors import StoreLockedError, UsageError
    from smartckpt_cli.remote.check import connect, prune_remote
    from smartckpt_cli.remote.replica import display_url
    from smartckpt_cli.store.leases import STALE_AFTER, LeaseHeld, holding

    if keep < 1:
        raise UsageError("--keep must be at least 1")
    rem, journal, _ = connect(url)
    why = f"smartckpt prune --keep {keep}"
    try:
        if dry_run:
            plan = prune_remote(rem, journal, keep, dry_run=True, why=why)
        else:
            with holding(rem, "prune", {"upload", "prune"}):
                plan = prune_remote(rem, journal, keep, why=why)
    except LeaseHeld as err:
        raise StoreLockedError(
            f"{display_url(url)} is being written ({err}); try again (a lease not renewed for "
            f"{STALE_AFTER / 60:.0f} min is a dead writer's)"
        ) from None
    if as_json:
        typer.echo(json.dumps({"dry_run": dry_run, "remote": _remote_json(plan)}, indent=2))
        return
    _say_remote(plan, "would remove" if dry_run else "removed", dry_run)


def _remote_json(plan: RemotePlan) -> dict[str, Any]:
    return {
        "kept": [r.step for r in plan.keep],
        "removed": [r.step for r in plan.remove],
        "blobs_removed": plan.blobs_removed,
    }


def _say_remote(plan: RemotePlan, verb: str, dry_run: bool) -> None:
    say(
        f"remote: {verb} steps {', '.join(str(r.step) for r in plan.remove) or 'none'}; kept steps "
        f"{', '.join(str(r.step) for r in plan.keep) or 'none'}"
        + ("" if dry_run else f"; {plan.blobs_removed} blob(s) removed")
    )


def _result_json(result: PruneResult, writer: str | None, remote_plan: RemotePlan | None) -> dict[str, Any]:
    plan = result.plan
    return {
        "dry_run": result.dry_run,
        "kept": [{"step": r.step, "id": r.id} for r in plan.keep],
        "removed": [{"step": r.step, "id": r.id} for r in plan.remove],
        "newest_verified": {"step": result.newest_verified.step, "id": result.newest_verified.id}
        if result.newest_verified
        else None,
        "bytes_freed": result.bytes_freed,
        "passed_over": result.unverified,
        "writer": writer,
        "remote": None if remote_plan is None else _remote_json(remote_plan),
    }


def _say_result(
    result: PruneResult, keep: int, writer: str | None, remote_plan: RemotePlan | None, dry_run: bool
) -> None:
    """What was kept and removed (or would be, with --dry-run), locally then remotely."""
    plan = result.plan
    for line in result.unverified:
        say(f"not verified, not counted as the newest good one: {line}", error=True)
    nv = result.newest_verified
    if nv is not None:
        say(f"newest verified checkpoint: step {nv.step} ({nv.id}), always kept")
    verb = "would remove" if result.dry_run else "removed"
    if not plan.remove:
        say(f"nothing to prune: {len(plan.keep)} live checkpoint(s), --keep {keep}")
    for r in plan.remove:
        say(f"{verb} step {r.step} ({r.id})")
    freed = "would free about" if result.dry_run else "freed"
    say(
        f"kept steps {', '.join(str(r.step) for r in plan.keep)}; {freed} {human(result.bytes_freed)}"
        + (f" (a run is writing this store: {writer})" if writer else "")
    )
    if remote_plan is not None:
        _say_remote(remote_plan, verb, dry_run)


def _prune_remote(store: object, url: str, keep: int, dry_run: bool) -> Any:
    """--keep on the remote side, under the store's remote.lock (never during an upload round)."""
    from smartckpt_cli.errors import StoreLockedError
    from smartckpt_cli.remote.check import REMOTE_LOCK, connect, prune_remote
    from smartckpt_cli.store.directory import StoreDir

    assert isinstance(store, StoreDir)
    rem, journal, _ = connect(url)
    try:
        with store.lock(REMOTE_LOCK, blocking=False):
            return prune_remote(rem, journal, keep, dry_run=dry_run, why=f"smartckpt prune --keep {keep}")
    except BlockingIOError:
        raise StoreLockedError(
            "a run is uploading this store to the remote right now; try again in a moment"
        ) from None
