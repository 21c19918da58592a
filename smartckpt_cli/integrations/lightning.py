"""Lightning (``pytorch_lightning`` or ``lightning.pytorch``): smartckpt decides when to save, and
saves into its store; a restarted ``fit`` resumes where the checkpoint left off.

    from smartckpt_cli.integrations.lightning import SmartCheckpointCallback

    trainer = pl.Trainer(max_steps=1000, callbacks=[SmartCheckpointCallback("ckpt")])
    trainer.fit(model, loader)

Under ``smartckpt run`` the callback is added to every Trainer by itself (:mod:`.auto`).

Order of calls (Lightning calls these hooks from the training thread):

1. ``attach``/``setup``: Lightning's ``ModelCheckpoint`` callbacks are taken off (no ``.ckpt``
   files), unless ``keep_trainer_saves=True``.
2. ``on_fit_start`` (optimizers exist; Lightning has not restored anything yet): the manager is
   built and given the module, the optimizers, the LR schedulers and Lightning's loop state
   (progress counters, and a ``StatefulDataLoader``'s position, which Lightning keeps in its loop
   state). When the store has a checkpoint and ``fit`` got no ``ckpt_path`` of its own, the module,
   optimizers and schedulers are loaded now and the loop state is handed to Lightning's own
   resume step (``restore_training_state``), which runs right after this hook exactly as for its
   own checkpoints. The preemption handlers are taken off again: Lightning installs its SLURM
   auto-requeue handler only where no handler is installed yet.
3. ``on_train_start``: smartckpt's preemption handlers go back on top of Lightning's; after the
   blocking save a signal is handed on to Lightning's handler, so its requeue still runs. Batches
   Lightning's data fetcher prefetches (of loaders without a length) are not counted as consumed.
   Lightning's own restore of its DataLoaders' states is replaced, on this Trainer's fit loop
   (``_load_combined_loader_states``, called by its ``setup_data`` right before it makes the data
   iterator): each loader Lightning will iterate (the one it rebuilt with a
   ``DistributedSampler`` under ddp) is registered and tracked by smartckpt (state/data.py:
   plain and ``StatefulDataLoader`` alike), and its position loaded from the checkpoint.
   Lightning's own resumed a ``StatefulDataLoader`` on another batch under ddp, and a plain
   ``DataLoader`` from its epoch's first batch.
4. ``on_train_batch_start`` (first batch after a resume only): the RNG state is restored, after
   Lightning has made its data iterator (which draws from the RNG as it did at the epoch start).
5. ``on_train_batch_end`` (after the optimizer step and the per-step LR schedulers, which is where
   Lightning's own mid-epoch checkpoints are taken too): ``manager.step(global_step, loss)``.
6. ``on_train_end``: a final checkpoint at the last step, and the manager is closed.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any

from torch.utils.data import DataLoader

from smartckpt_cli.engine.heartbeat import total_steps
from smartckpt_cli.integrations._common import StateFn, build_manager, state_of

if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
    import lightning.pytorch as pl
else:
    try:
        import pytorch_lightning as pl
    except ImportError:  # only the unified package is installed
        import lightning.pytorch as pl

__all__ = ["SmartCheckpointCallback"]

logger = logging.getLogger(__name__)

LOOPS = "lightning"  # the name Lightning's loop state is stored under


class SmartCheckpointCallback(pl.Callback):
    """Checkpoints a Lightning Trainer with smartckpt (see the module docstring).

    ``directory`` and ``settings`` (any :class:`~smartckpt_cli.config.Settings` field) build the
    manager, unless ``manager`` is given. ``keep_trainer_saves``: keep Lightning's own
    ``ModelCheckpoint`` callbacks."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        manager: Any = None,
        keep_trainer_saves: bool = False,
        auto: bool = False,
        **settings: Any,
    ) -> None:
        self._directory, self._settings, self.manager = directory, settings, manager
        self.keep_trainer_saves = keep_trainer_saves
        self.auto = auto
        self._own = manager is None
        self._rng_from: Any = None  # the checkpoint whose RNG state the first batch gets
        self._data_from: Any = None  # ... and whose loader positions setup_data gets
        self._loaders: list[Any] = []  # the trackers of the loaders Lightning iterates
        self._saved: int | None = None
        self.restored_step = 0  # the step the last fit/train resumed from (0: started afresh)

    def attach(self, trainer: Any) -> SmartCheckpointCallback:
        """Add this callback to an already built Trainer. Returns self."""
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)
        self._drop_model_checkpoints(trainer)
        return self

    def _drop_model_checkpoints(self, trainer: Any) -> None:
        if self.keep_trainer_saves:
            return
        from_lightning = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelCheckpoint)]
        if from_lightning:
            trainer.callbacks = [c for c in trainer.callbacks if c not in from_lightning]
            logger.info("smartckpt checkpoints this run: Lightning's ModelCheckpoint is off")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._drop_model_checkpoints(trainer)

    # ------------------------------------------------------------------ resume

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.manager is None:
            self.manager = build_manager(None, self._directory, self._settings)
        mgr = self.manager
        names = self._register(trainer, pl_module)
        connector = trainer._checkpoint_connector
        loaded = mgr.read() if not connector._loaded_checkpoint else None
        mgr.remove_signal_handlers()
        self._data_from = loaded
        fit_loop = trainer.fit_loop
        fit_loop._load_combined_loader_states = lambda: self._load_loaders(fit_loop)
        if loaded is None:
            return
        loops = state_of(loaded, LOOPS)
        if loops is None:
            raise ValueError(f"the checkpoint of step {loaded.record.step} holds no Lightning loop state")
        mgr.apply(loaded, names)
        # Lightning's own resume step (restore_training_state, right after this hook) restores the
        # loops from this; optimizers and schedulers are already loaded, it loads them again as is.
        connector._loaded_checkpoint = {
            "loops": loops["loops"],
            "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            "epoch": loops["epoch"],
            "global_step": loops["global_step"],
        }
        self._rng_from = loaded
        self._saved = self.restored_step = loaded.record.step
        logger.info("resuming the Lightning Trainer at global step %d", loaded.record.step)

    def _register(self, trainer: Any, pl_module: Any) -> list[str]:
        objects: dict[str, Any] = {"model": pl_module}
        opts = trainer.optimizers
        objects.update({"optimizer" if len(opts) == 1 else f"optimizer{i}": o for i, o in enumerate(opts)})
        scheds = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        objects.update(
            {"scheduler" if len(scheds) == 1 else f"scheduler{i}": s for i, s in enumerate(scheds)}
        )
        self.manager.register(**objects)

        def loops() -> dict[str, Any]:
            fit = trainer.fit_loop.state_dict()
            # the loaders' positions are registered objects of their own (_load_loaders)
            fit.get("state_dict", {}).pop("combined_loader", None)
            return {
                "loops": {"fit_loop": fit},
                "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
            }

        self.manager.register(**{LOOPS: StateFn(loops)})
        return list(objects)

    def _load_loaders(self, fit_loop: Any) -> None:
        """In place of Lightning's restore of its loaders' states (module docstring, 2): the
        loaders it is about to iterate, registered and, on a resume, positioned."""
        from smartckpt_cli.state.data import LoaderState
        from smartckpt_cli.state.registry import DATA

        fit_loop._combined_loader_states_to_load = []  # not Lightning's: smartckpt's, below
        combined = fit_loop._combined_loader
        loaders = list(combined.flattened) if combined is not None else []
        names = ["data"] if len(loaders) == 1 else [f"data{i}" for i in range(len(loaders))]
        self._loaders = []
        for name, loader in zip(names, loaders, strict=True):
            if isinstance(loader, DataLoader):
                tracker = LoaderState.of(loader)
                self.manager.register_as(name, tracker, kind=DATA)
                self._loaders.append(tracker)
        loaded, self._data_from = self._data_from, None
        if loaded is not None:
            saved = loaded.manifest.get("objects", {})
            self.manager.apply(loaded, [n for n in names if n in saved and n in self.manager.names()])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.manager.install_signal_handlers()
        total_steps(_total(trainer))
        # Lightning's data fetcher fetches this many batches ahead of the one being trained on
        # (none when the loaders have a length: it knows the last batch without)
        fetcher = trainer.fit_loop._data_fetcher
        sized = getattr(fetcher, "length", None) is not None
        ahead = 0 if sized else int(getattr(fetcher, "prefetch_batches", 0) or 0)
        for tracker in self._loaders:
            tracker.lookahead = ahead

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        loaded, self._rng_from = self._rng_from, None
        if loaded is not None:
            self.manager.apply(loaded, ["rng"])

    # ------------------------------------------------------------------ saving

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = loss.detach() if loss is not None and hasattr(loss, "detach") else None
        if self.manager.step(trainer.global_step, loss=loss).saved:
            self._saved = trainer.global_step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        mgr = self.manager
        if mgr is None:
            return
        if self._saved != trainer.global_step:
            mgr.save(trainer.global_step, reason="final", blocking=True)
            self._saved = trainer.global_step
        if self._own:
            mgr.close()
            self.manager = None
        else:
            mgr.wait()


def _total(trainer: Any) -> int | None:
    """The optimizer steps this fit takes: max_steps, else what Lightning estimates from the
    epochs and the loaders (infinite or unknown: None)."""
    if int(getattr(trainer, "max_steps", -1) or -1) > 0:
        return int(trainer.max_steps)
    try:
        n = float(trainer.estimated_stepping_batches)
    except Exception:  # an iterable without a length: Lightning cannot say
        return None
    return int(n) if math.isfinite(n) and n > 0 else None
