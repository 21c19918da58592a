"""``smartckpt prune``: keep the newest N checkpoints, remove the rest and unreferenced blobs."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from smartckpt_cli.cli._shared import DirArg, MetaDirOpt, human, progress_bar, say

__all__ = ["prune"]


def prune(
    directory: DirArg,
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

    \b
    Exit codes:
      0  pruned (or nothing to prune)
      1  no checkpoint verifies, the journal is damaged or a manifest unreadable, or a save
         held the lock past --wait (nothing is removed)
      2  bad input: not a store, --keep below 1
    """
    from smartckpt_cli.catalog import active_writer
    from smartckpt_cli.prune import carry_out
    from smartckpt_cli.store_dir import open_store

    store = open_store(directory, meta_dir)
    writer = active_writer(store)
    with progress_bar("verifying the newest checkpoint") as progress:
        result = carry_out(store, keep, dry_run=dry_run, lock_timeout=wait, progress=progress)
    plan = result.plan
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "dry_run": result.dry_run,
                    "kept": [{"step": r.step, "id": r.id} for r in plan.keep],
                    "removed": [{"step": r.step, "id": r.id} for r in plan.remove],
                    "newest_verified": {"step": result.newest_verified.step, "id": result.newest_verified.id}
                    if result.newest_verified
                    else None,
                    "bytes_freed": result.bytes_freed,
                    "passed_over": result.unverified,
                    "writer": writer,
                },
                indent=2,
            )
        )
        return
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
