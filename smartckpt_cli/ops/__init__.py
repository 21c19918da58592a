"""Operations over a store, for the command line: :mod:`.verify`, :mod:`.prune`, :mod:`.rollback`,
:mod:`.catalog` (``inspect``), :mod:`.config_report` (``config show``) and :mod:`.bench_result`
(what ``smartckpt bench`` measured) never import torch; :mod:`.export` (a checkpoint as one
standard file), :mod:`.bench` (``smartckpt bench``: its parts, run in order) with
:mod:`.bench_model` (the model it trains), :mod:`.bench_savers` (the other tools) and
:mod:`.bench_throughput` (training throughput while saving), and :mod:`.demo_train`
(``smartckpt demo``'s training) do, inside the commands that need tensors.
"""
