"""A run's timeline: what the trigger saw and decided, what each failure cost, as data.

``smartckpt plot`` draws it (:mod:`smartckpt_cli.figures`) or prints it as JSON. Everything here
is plain data and numpy, no matplotlib and no torch, so the JSON form works in the control
plane and on machines without the ``plot`` extra.

Sources, all already on disk (nothing new is recorded for the plot):

- the **journal**: every checkpoint, its reason, score, health, calm flag, and whether it was
  pruned or rolled back; failed saves;
- the **trace files** (``<meta_dir>/traces/*.csv``, one per process): loss, curvature, gradient
  variance, planned update, score, memory when recorded, read by column name so that traces
  of older and newer versions both plot;
- the **run records** of ``smartckpt run`` (``<dir>/runs/*.json``): every attempt's end, cause,
  the checkpoint it restarted from, and the steps and seconds it lost;
- ``remote-status.json``: which checkpoints the remote tier has not uploaded yet.

Modules, in the order data flows: :mod:`.tracetable` (CSV to columns, fast),
:mod:`.place` (which time each checkpoint was taken at), :mod:`.kinds` (reason categories and
failure labels), :mod:`.decimate` (min/max per pixel column), :mod:`.build` (all of it into a
:class:`~.model.Timeline`), :mod:`.load` (the reading, the only I/O).
"""

from smartckpt_cli.timeline.build import (
    PlotOptions,
    StoreFacts,
    build_timeline,
    parse_steps,
    recorded_settings,
)
from smartckpt_cli.timeline.decimate import minmax
from smartckpt_cli.timeline.kinds import CATEGORIES, reason_category, restart_label
from smartckpt_cli.timeline.load import load_store
from smartckpt_cli.timeline.model import (
    CheckpointMark,
    FailedSave,
    Mark,
    RestartMark,
    Segment,
    Series,
    Timeline,
)
from smartckpt_cli.timeline.tracetable import TraceTable, parse_table, read_table

__all__ = [
    "CATEGORIES",
    "CheckpointMark",
    "FailedSave",
    "Mark",
    "PlotOptions",
    "RestartMark",
    "Segment",
    "Series",
    "StoreFacts",
    "Timeline",
    "TraceTable",
    "build_timeline",
    "load_store",
    "minmax",
    "parse_steps",
    "parse_table",
    "read_table",
    "reason_category",
    "recorded_settings",
    "restart_label",
]
