"""What a training state is, and how it goes back into the objects it came from.

:mod:`.tree` (any ``state_dict()`` as a tagged JSON skeleton plus tensors, no pickle),
:mod:`.registry` (what kind of object each registered thing is), :mod:`.tiers` (which tier each
entry belongs to, at which precision; pure), :mod:`.precision` (tensors as bytes; reduced
precisions that never lose a value), :mod:`.dtypes` (every dtype torch has, as stored bytes),
:mod:`.optstate` (an optimizer's per-element moments beside its parameters, and whether a
checkpoint fits the live optimizer), :mod:`.rng` (every random generator, exactly),
:mod:`.data` (a DataLoader's position), :mod:`.data_carry` (whether a saved position
carries onto the live loader exactly, or the rest of the epoch is dealt afresh), :mod:`.data_reshard` (the rest of an epoch dealt to another
number of ranks; pure), :mod:`.shards` (which rows of a ``Shard(dim)`` tensor each rank holds, at
any world size; pure), :mod:`.apply` (load a verified checkpoint in place:
everything checked before anything is loaded).
"""
