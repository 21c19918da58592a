"""Figures: the only modules that import matplotlib, and only when a figure is drawn.

:mod:`.base` (matplotlib on Agg, colours, units, PNG/SVG/HTML output), :mod:`.timeline`
(``smartckpt plot``: a run's timeline), :mod:`.simulation` (``smartckpt simulate --plot``: the
checkpoints each policy would have taken on one trace). Importing this package imports neither
matplotlib nor torch.
"""

from smartckpt_cli.figures.base import FORMATS, check_output, save

__all__ = ["FORMATS", "check_output", "save"]
