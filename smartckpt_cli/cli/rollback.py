"""``smartckpt rollback``: make the next resume start from an earlier checkpoint, or undo that."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smartckpt_cli.cli._shared import DirArg, MetaDirOpt, say

if TYPE_CHECKING:
    from smartckpt_cli.ops.rollback import RollbackPlan
    from smartckpt_cli.store.directory import StoreDir
    from smartckpt_cli.store.journal import CheckpointRecord

__all__ = ["rollback"]


def rollback(
    directory: DirArg,
    to: Annotated[int | None, typer.Option("--to", help="Resume from this step next time.")] = None,
    to_prev: Annotated[
        bool, typer.Option("--to-prev", help="Resume from the checkpoint before the newest one.")
    ] = False,
    undo: Annotated[bool, typer.Option("--undo", help="Reverse the newest rollback still in force.")] = False,
    meta_dir: MetaDirOpt = None,
) -> None:
    """Make the next resume start from an earlier checkpoint (or --undo that).

    Records a rollback in the journal: checkpoints newer than the target stop being restore
    candidates. Nothing is deleted; inspect shows them as 'rolled back' and --undo makes them
    live again. The target is verified first.

    \b
    Examples:
      smartckpt rollback ./checkpoints --to-prev
      smartckpt rollback ./checkpoints --to 1200
      smartckpt rollback ./checkpoints --undo

    \b
    Exit codes:
      0  recorded
      1  the target checkpoint is corrupt, or the journal cannot be read or
         written
      2  bad input: not a store, no such step, nothing to roll back or undo
    """
    from smartckpt_cli.ops.catalog import active_writer
    from smartckpt_cli.ops.rollback import plan_rollback
    from smartckpt_cli.store.directory import open_store

    store = open_store(directory, meta_dir)
    state, events = store.journal.read_events(consistent=True)
    plan = plan_rollback(state.records, events, to_step=to, to_prev=to_prev, undo=undo)
    if plan.target is not None:
        _refuse_corrupt_target(store, plan.target)
    store.journal.append(plan.event)
    _say_done(directory, plan)
    writer = active_writer(store)
    if writer:
        say(
            f"warning: a run is writing this store ({writer}); checkpoints it commits from now on "
            "are live and newer, so stop it before resuming from the rollback",
            error=True,
        )


def _refuse_corrupt_target(store: StoreDir, target: CheckpointRecord) -> None:
    """A resume would skip a target that does not verify (a restore passes over a damaged
    checkpoint), so the rollback would not do what was asked: refused before the journal line."""
    from smartckpt_cli.errors import CheckpointCorrupt
    from smartckpt_cli.ops.verify import verify

    report = verify(store, step=target.step)
    bad = [r for r in report.results if r.id == target.id and not r.ok]
    if bad:
        raise CheckpointCorrupt(
            f"step {target.step} ({target.id}) does not verify, not rolling back to it: {bad[0].problem}"
        )


def _say_done(directory: Path, plan: RollbackPlan) -> None:
    if plan.target is not None:
        steps = ", ".join(str(r.step) for r in plan.hidden)
        say(f"rolled back to step {plan.target.step} ({plan.target.id}); rolled back: steps {steps}")
        say(
            f"the next resume starts from step {plan.target.step}; undo with: smartckpt rollback {directory} --undo"
        )
    else:
        steps = ", ".join(str(r.step) for r in plan.restored) or "none"
        say(f"rollback undone; live again: steps {steps}")
