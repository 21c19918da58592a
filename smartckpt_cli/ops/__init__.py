"""Operations over a store, for the command line: :mod:`.verify`, :mod:`.prune`, :mod:`.rollback`,
:mod:`.catalog` (``inspect``), :mod:`.config_report` (``config show``) never import torch;
:mod:`.export` (a checkpoint as one standard file), :mod:`.bench` with :mod:`.bench_savers` and
:mod:`.bench_throughput` (``smartckpt bench``) and :mod:`.demo_train` (``smartckpt demo``'s
training) do, inside the commands that need tensors.
"""
