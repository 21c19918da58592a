"""What ``smartckpt run`` injects into an unmodified training script (through
``hooks/sitecustomize.py``): :mod:`.runtime` (the global optimizer hooks, ``start_step``, arming
and exit) and :mod:`.zerocode` (finding the model, optimizers, schedulers and loaders of a plain
loop, and the exact step boundary at which they are saved).
"""
