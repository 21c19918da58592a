"""What ``smartckpt run`` injects into an unmodified training script (through
``hooks/sitecustomize.py``): :mod:`.runtime` (the global optimizer hooks, ``start_step``, arming
and exit), :mod:`.zerocode` (finding the model, optimizers, schedulers and loaders of a plain
loop, and the exact step boundary at which they are saved), :mod:`.naming` (the same name for each
training object in every run of a script) and :mod:`.nooptimizer` (a loop that runs ``backward()``
but never steps a torch.optim optimizer, said once).
"""
