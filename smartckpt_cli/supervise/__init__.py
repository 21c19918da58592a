"""``smartckpt run``'s own process: it watches the training, never imports torch and never
imports the engine (it reads the heartbeat files the training writes).

:mod:`.supervisor` (the loop: spawn, watch, restart), :mod:`.launch` (each attempt's process,
in the warm spare when one is ready), :mod:`.poll` (one attempt's watch: hang clock, heartbeats,
the grace-period kill, how it ended), :mod:`.hearing` (acting on what the child reports),
:mod:`.runstart` (the checks before the first attempt), :mod:`.runstate` (what the CLI gives it and
the live view it keeps), :mod:`.forward` (signals passed to the child; killing its tree),
:mod:`.watch` (heartbeats, the child's output, a hang's stack dump), :mod:`.restarts` (between
attempts: work lost, rollback, diagnosis, the wait), :mod:`.policy` (what to do after an
exit or a hang; pure), :mod:`.child` (the child's command, environment and the files it leaves),
:mod:`.records` (run records under ``<dir>/runs/``), :mod:`.monitor` (CPU, memory and GPU use),
:mod:`.slurm` (which job and attempt this is; requeue after a preemption).
"""
