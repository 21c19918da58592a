"""Replay a signal trace under each trigger policy: what each would have saved, and what it costs.

Pure, except :func:`read_trace`. ``smartckpt simulate`` is a thin wrapper around
:func:`read_trace` and :func:`simulate`.

**Trace.** The CSV files :mod:`smartckpt_cli.trigger.trace` writes (step, time, loss, curvature,
grad_var, score, decision; an optional ``onset`` column marks divergence onsets by hand), one per
run. The run is the span of the trace, from its first row to its last.

**Replay.** Each policy (fixed interval, the seed's score, smartckpt's adaptive policy), wrapped
in :class:`~smartckpt_cli.trigger.bounded.Bounded` with the same ``min_interval``/``max_interval``, sees
every row as a :class:`~smartckpt_cli.trigger.context.TriggerContext` built as the manager builds it:
``now`` = the row's time, the newest save taken (or the start), the row's signals as the
reading, ``save_cost``/``save_total``/``mtbf`` from the options. Policies are consulted on trace
rows only (the manager consults them every step; with a trace of ``eval_every`` > 1, a fixed or
budget save lands on the next row). A save taken at time t commits at t + ``save_total``; one
save is in flight at a time, so a save due while another is in flight starts when that one
commits (the manager's ``inflight="wait"``) and the wait is counted as overhead. The timeline
itself is not stretched. A save at a row whose loss is not finite is unhealthy, as in the
manager: it is taken (and costs) but restores nothing and does not reset the schedule.

**Calibration** (the same number of checkpoints for every policy). Each policy has one knob
that makes it save more or less often: the fixed interval in seconds, the seed's threshold, and
for the adaptive policy a scale on its interval (MTBF × scale², since Young/Daly's interval grows
with √MTBF; before any save cost is known, its interval is ``max_interval`` / 2, also scaled).
Without ``checkpoints``, the adaptive policy runs as configured and the others are calibrated to
its count; with ``checkpoints`` = N, all three are. A knob's values that give exactly N saves
form a range; a baseline (fixed, seed) gets the value in that range with the *least* expected
lost work, its best case, so an advantage of the adaptive policy is never an unlucky phase of
the baseline's schedule; a calibrated adaptive policy gets the middle of its range. When no value
gives exactly N, the nearest count is used and the result says so.

**Expected lost work.** A failure at time t loses t − s, with s the snapshot time of the newest
healthy checkpoint committed by t (the start of the run before the first). Poisson failures
fall uniformly in time, so the mean loss per failure is the time average of t − s over the run,
integrated exactly over the piecewise-linear timeline; over the whole run, T / MTBF failures are
expected, each losing that mean.

**Divergence events.** Onsets are the ``onset`` column, or steps given explicitly, or detected:
the trace's loss is median-filtered again over ``spike_window`` rows (f); the first row where
f exceeds a robust baseline by ``spike_k`` × MAD starts an event. The baseline is the median of
the last ``spike_baseline`` non-event rows; the MAD (median absolute deviation, unscaled) is
that of the last ``spike_noise`` residuals of non-event rows against the baseline before them,
so a falling loss moves the baseline without inflating the MAD, and a calm stretch of a few
rows cannot shrink it (both failure modes showed on real traces: a MAD of the levels
themselves missed real spikes after a trend and fired on noise after a calm stretch). The event
ends at the first row where f is back at or below that threshold (or at the trace's end).

The rollback is decided at the event's end (``rollback="end"``: someone noticed the spike once it
was over, the most retention can have evicted by then) or at the onset itself (``"onset"``: an
automatic monitor acted at once). Retention is replayed on every commit up to that moment
(``select_prunable`` with ``keep_last`` and the calm flag, so the newest calm checkpoint is
never evicted), and the newest retained healthy checkpoint taken strictly before the onset (by
step) is where the run goes back to. Per onset: its distance to the onset (seconds), and the
work lost by rolling back to it (from its snapshot to the decision). Without any retained
checkpoint before the onset, the run restarts from the beginning (counted as ``missed``,
distances measured from the start).
"""

from smartckpt_cli.simulate.engine import simulate
from smartckpt_cli.simulate.onsets import Onset, detect_onsets, retained_before
from smartckpt_cli.simulate.replay import Save, SimConfig, mean_lost_work, replay
from smartckpt_cli.simulate.results import OnsetResult, PolicyResult, SimResult
from smartckpt_cli.simulate.trace import POLICIES, Trace, TraceRow, parse_trace, read_trace

__all__ = [
    "POLICIES",
    "Onset",
    "OnsetResult",
    "PolicyResult",
    "Save",
    "SimConfig",
    "SimResult",
    "Trace",
    "TraceRow",
    "detect_onsets",
    "mean_lost_work",
    "parse_trace",
    "read_trace",
    "replay",
    "retained_before",
    "simulate",
]
