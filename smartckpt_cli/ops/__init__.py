"""Operations over a store, for the command line: :mod:`.verify`, :mod:`.prune`, :mod:`.rollback`,
:mod:`.catalog` (``inspect``), :mod:`.config_report` (``config show``) and :mod:`.repair` never
import torch; :mod:`.export` (a checkpoint as one standard file) and :mod:`.demo_train`
(``smartckpt demo``'s training) do, inside the commands that need tensors. The benchmark harness
is :mod:`smartckpt_cli.bench`.
"""
