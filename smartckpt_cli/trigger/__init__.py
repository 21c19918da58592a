"""WHEN to save: the training's signals and the policies that read them.

:mod:`.signals` (median-filtered loss curvature, gradient variance: reductions on the device, read
back without stalling it), :mod:`.planned` (the planned update: the norm of the step the optimizer
is about to apply), :mod:`.memory` (how close the process is to the memory ceiling that would kill
it), :mod:`.reading` (one evaluation as plain numbers), :mod:`.policies` (the policy interface and
:func:`~.policies.make_policy`; it re-exports the policies), :mod:`.context` (a
:class:`~.context.TriggerContext` in, a :class:`~.context.Decision` out), :mod:`.scores` (the
seed's score, Young/Daly's interval), :mod:`.simple` (``fixed`` and ``seed``), :mod:`.adaptive`
(the default policy), :mod:`.pressure` (memory pressure), :mod:`.bounded` (the lost-work budget
around every policy), :mod:`.cost` (what a save costs: a moving average of recent
saves), :mod:`.trace` (one CSV line per evaluation, for ``simulate`` and ``plot``).
"""
