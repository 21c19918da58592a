"""``smartckpt rollback``: make the next resume start from an earlier checkpoint, or undo that.

A rollback is one journal line, ``{"event": "rollback", "to_step": S}``: every checkpoint
committed before it with a step above S stops being a restore candidate (``inspect`` shows it as
rolled back). Nothing is deleted, so ``{"undo": true}`` reverses the newest rollback still in
force. Deciding (:func:`plan_rollback`) is pure; the target is verified before the line is
written, so a rollback never points a resume at a checkpoint that would not load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smartckpt_cli.errors import UsageError
from smartckpt_cli.store.checkpoints import candidates
from smartckpt_cli.store.journal import CheckpointRecord

__all__ = ["RollbackPlan", "plan_rollback"]


@dataclass
class RollbackPlan:
    event: dict[str, Any]
    target: CheckpointRecord | None  # what the next resume loads (None for an undo: see after)
    hidden: list[CheckpointRecord] = field(default_factory=list)  # rolled back by this line
    restored: list[CheckpointRecord] = field(default_factory=list)  # live again after an undo


def plan_rollback(
    records: list[CheckpointRecord],
    events: list[dict[str, Any]],
    *,
    to_step: int | None = None,
    to_prev: bool = False,
    undo: bool = False,
) -> RollbackPlan:
    """Pure: the journal event for ``--to STEP``, ``--to-prev`` or ``--undo``, or a UsageError
    saying why it makes no sense for this store."""
    if sum([to_step is not None, to_prev, undo]) != 1:
        raise UsageError("give exactly one of --to STEP, --to-prev or --undo")
    live = candidates(records)  # live, healthy, newest first
    if undo:
        from smartckpt_cli.store.journal import fold

        in_force = _rollbacks_in_force(events)
        if not in_force:
            raise UsageError("there is no rollback to undo")
        after = fold([*events, {"event": "rollback", "undo": True}])[1]
        back = {r.id for r in after if r.live}
        restored = _newest_first([r for r in records if r.rolled_back and r.id in back])
        return RollbackPlan({"event": "rollback", "undo": True}, None, restored=restored)
    if not live:
        raise UsageError("the store has no live healthy checkpoint to roll back from")
    target: CheckpointRecord | None
    if to_prev:
        if len(live) < 2:
            raise UsageError(f"step {live[0].step} is the only live checkpoint; there is no previous one")
        target = live[1]
    else:
        target = next((r for r in live if r.step == to_step), None)
        if target is None:
            known = [r for r in records if r.step == to_step]
            if known:
                why = (
                    "was pruned"
                    if all(r.pruned for r in known)
                    else "is rolled back (undo that rollback first)"
                    if any(r.rolled_back and not r.pruned for r in known)
                    else f"is not healthy ({known[-1].health}) and is never restored"
                )
                raise UsageError(f"cannot roll back to step {to_step}: it {why}")
            steps = ", ".join(str(r.step) for r in live)
            raise UsageError(f"no checkpoint of step {to_step} in this store (live steps: {steps})")
    assert target is not None
    hidden = _newest_first([r for r in records if r.live and r.step > target.step])
    if not hidden:
        raise UsageError(
            f"step {target.step} is already what a resume loads; nothing to roll back "
            f"(live steps: {', '.join(str(r.step) for r in live)})"
        )
    event = {"event": "rollback", "to_step": target.step, "why": "operator", "by": "smartckpt rollback"}
    return RollbackPlan(event, target, hidden=hidden)


def _newest_first(records: list[CheckpointRecord]) -> list[CheckpointRecord]:
    return sorted(records, key=lambda r: r.position, reverse=True)


def _rollbacks_in_force(events: list[dict[str, Any]]) -> int:
    """How many rollbacks an undo could still reverse (fold keeps them as a stack)."""
    depth = 0
    for ev in events:
        if ev.get("event") == "rollback":
            depth = max(0, depth - 1) if ev.get("undo") else depth + 1
    return depth
