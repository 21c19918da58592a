"""HOW a save and a restore happen, inside the training process.

:mod:`.manager` (``CheckpointManager``: the facade users touch), :mod:`.stepping` (what
``step()`` and the optimizer pre-hook do at every step), :mod:`.saving` (the snapshot, the
persist on the save thread, retention), :mod:`.cadence` (how often that does anything),
:mod:`.coordinator` (one process or several ranks behind one interface: open, agree to save,
persist, restore), :mod:`.observers` (who hears of commits and where restores look: the remote
tier plugs in there), :mod:`.snapshot` (the one copy the loop waits for), :mod:`.writer` (encode,
write and commit off the training thread), :mod:`.restore` (the newest checkpoint that verifies,
read into memory), :mod:`.reshard` (a checkpoint of another world size read for this rank:
its rows of every sharded tensor from the old shards that overlap them), :mod:`.prestep` (the state at the last step boundary, for a save before a
suspicious update), :mod:`.preempt` (SIGTERM/SIGUSR1 make the next boundary save),
:mod:`.distributed` and :mod:`.multirank` (the collectives of several ranks: agreement on one
step, two-phase commit), :mod:`.heartbeat` (what this process tells ``smartckpt run``).
"""
