"""WHEN to save: the training's signals and the policies that read them.

:mod:`.signals` (median-filtered loss curvature, gradient variance, the planned update: reductions
on the device, read back without stalling it), :mod:`.memory` (how close the process is to the
memory ceiling that would kill it), :mod:`.reading` (one evaluation as plain numbers),
:mod:`.policies` (pure policies: a :class:`~.policies.TriggerContext` in, a decision out; the
work budget bound), :mod:`.cost` (what a save costs: a moving average of recent saves),
:mod:`.trace` (one CSV line per evaluation, for ``simulate`` and ``plot``).
"""
