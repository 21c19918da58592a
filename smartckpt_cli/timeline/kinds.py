"""Names for what a reader compares: a checkpoint's reason in a few categories, a failure's
cause in one word. Pure; the figure colours by these, the JSON carries both the original text
and the category."""

from __future__ import annotations

import re

__all__ = ["CATEGORIES", "policies_shown", "reason_category", "restart_label"]

# Display order (the legend's). What each covers:
CATEGORIES = (
    "scheduled",  # the policy's interval ("interval 92s") or a fixed schedule ("every 50 steps")
    "budget",  # the lost-work budget forced it (max_interval)
    "precursor",  # saved before an update the signals warned about (the step before it)
    "signal",  # the signals after the update (the adaptive "risk alarm", the seed score)
    "preemption",  # SIGTERM/SIGUSR1/SIGUSR2: the blocking save before the process goes
    "final",  # the end of training (zero-code, the Trainer callbacks)
    "manual",  # mgr.save() with any other reason
)


def reason_category(reason: str) -> str:
    r = reason.strip().lower()
    if r.startswith("precursor"):
        return "precursor"
    if r.startswith("lost-work budget"):
        return "budget"
    if r.startswith(("interval ", "every ")):
        return "scheduled"
    if r in ("risk alarm", "seed score", "rank 0 trigger"):
        return "signal"
    if r.startswith("preemption"):
        return "preemption"
    if r == "final":
        return "final"
    return "manual"


_EVERY = re.compile(r"every (\d+ steps|[\d.]+s)$")


def policies_shown(reasons: list[str]) -> list[tuple[str, str]]:
    """The policies the checkpoints were taken by, read from their reasons, in the order they
    first appear: ``("fixed", "every 10 steps")``, ``("adaptive", "")``, ``("seed", "")``. The
    budget, a preemption, the end of training, a manual save and another rank's "rank 0 trigger"
    say nothing of the policy."""
    seen: list[tuple[str, str]] = []
    for reason in reasons:
        r = reason.strip().lower()
        m = _EVERY.match(r)
        if m:
            found = ("fixed", m.group(0))
        elif r == "seed score":
            found = ("seed", "")
        elif r == "risk alarm" or r.startswith(("precursor", "interval ")):
            found = ("adaptive", "")
        else:
            continue
        if found not in seen:
            seen.append(found)
    return seen


_SIGNAL = re.compile(r"\b(SIG[A-Z0-9]+)\b")


def restart_label(category: str, cause: str) -> str:
    """One word for a failed attempt: SIGKILL, OOM, hang, GPU, preemption, error, stopped."""
    if category == "signal":
        m = _SIGNAL.search(cause)
        return m.group(1) if m else "signal"
    return {
        "oom": "OOM",
        "hang": "hang",
        "gpu": "GPU",
        "preempted": "preemption",
        "stopped": "stopped",
    }.get(category, "error")
