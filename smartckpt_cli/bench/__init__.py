"""``smartckpt bench`` and the harness the scripts in benchmarks/ share: the bench model
(``model``), the contenders (``savers``), the runs (``run``, ``throughput``) and the result files
(``result``, ``record``). Not a layer of the checkpointer: it measures it from outside."""
