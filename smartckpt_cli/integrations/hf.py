"""Hugging Face ``transformers.Trainer``: smartckpt decides when to save, and saves into its store.

    from smartckpt_cli.integrations.hf import SmartCheckpointCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    SmartCheckpointCallback("ckpt").attach(trainer)   # adds itself; resumes in train()
    trainer.train()

Under ``smartckpt run`` this happens by itself for every Trainer (:mod:`.auto`).

Order of calls (all from the training thread):

1. ``attach(trainer)`` adds the callback and wraps this Trainer instance's ``train`` and
   ``training_step`` (the latter only to see each step's loss, kept on its device).
2. ``trainer.train()``: the wrapper builds the manager and reads the newest verified checkpoint.
   When there is one (and the caller passed no ``resume_from_checkpoint`` of their own) it loads
   the model weights, writes the checkpoint's ``TrainerState`` as ``trainer_state.json`` into a
   temporary folder and hands that folder to the Trainer's own resume path. The Trainer then sets
   ``global_step``, ``epoch`` and its callbacks' state from it and skips the batches already
   trained exactly as it does for its own checkpoints; it finds no weights, optimizer or RNG files
   there, so for this one call ``_load_from_checkpoint`` does nothing (the weights are loaded
   already) and ``_load_rng_state`` restores smartckpt's RNG state at the very point the Trainer
   would restore its own (at the epoch start, or after the first batch of a skipped-into epoch).
3. ``on_train_begin``: optimizer, scheduler and the TrainerState are registered; the optimizer
   and scheduler are loaded from the checkpoint.
4. ``on_step_end`` (``global_step`` counts the optimizer step just taken): ``manager.step`` feeds
   the trigger and saves when it fires. ``control.should_save`` is cleared, so the Trainer writes
   no ``checkpoint-*`` folders of its own, unless ``keep_trainer_saves=True``.
5. ``on_train_end``: a final checkpoint at the last step (a restarted, finished run then does no
   extra step), and the manager is closed.

The Trainer's private ``_load_from_checkpoint`` and ``_load_rng_state`` are replaced on the one
instance and for the one call only; checked against transformers 5.24.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import types
from typing import Any

from transformers import TrainerCallback

from smartckpt_cli.engine.heartbeat import total_steps
from smartckpt_cli.integrations._common import StateFn, build_manager, state_of

__all__ = ["SmartCheckpointCallback"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer"  # the name TrainerState is stored under


class SmartCheckpointCallback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` with smartckpt (see the module docstring).

    ``directory`` and ``settings`` (any :class:`~smartckpt_cli.config.Settings` field, such as
    ``keep_last`` or ``every_steps``) build the manager, unless ``manager`` is given.
    ``keep_trainer_saves``: let the Trainer write its own ``checkpoint-*`` folders too."""

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
        self.auto = auto  # added by `smartckpt run`: a callback the user attaches replaces it
        self.trainer: Any = None
        self._loaded: Any = None  # the checkpoint being resumed from, until on_train_begin
        self._loss: Any = None
        self._own = manager is None  # built (and closed) here
        self._saved: int | None = None
        self.restored_step = 0  # the step the last train() resumed from (0: started afresh)

    # ------------------------------------------------------------------ attach

    def attach(self, trainer: Any) -> SmartCheckpointCallback:
        """Add this callback to ``trainer`` (replacing one ``smartckpt run`` added) and wrap the
        instance's ``train`` so that it resumes from smartckpt's store. Returns self."""
        for cb in list(trainer.callback_handler.callbacks):
            if isinstance(cb, SmartCheckpointCallback) and cb is not self:
                if not cb.auto:
                    raise ValueError("this Trainer already has a SmartCheckpointCallback")
                trainer.remove_callback(cb)
                cb.trainer = None
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.trainer = trainer
        cls = type(trainer)
        trainer.train = lambda *a, **kw: self._train(cls.train, *a, **kw)
        inner_step = types.MethodType(cls.training_step, trainer)  # not an earlier attach's wrapper

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = inner_step(*args, **kwargs)
            # Detached by the Trainer; stays on its device (no sync). With gradient accumulation
            # each micro-step returns its share (loss / steps): their sum is the step's loss, the
            # one the Trainer logs.
            self._loss = loss if self._loss is None else self._loss + loss
            return loss

        trainer.training_step = training_step
        return self

    def _train(self, train: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        if self.manager is None:
            self.manager = build_manager(None, self._directory, self._settings)
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume not in (None, False):
            logger.warning("resume_from_checkpoint given: the Trainer resumes from it, not from smartckpt")
            return train(trainer, *args, **kwargs)
        loaded = self.manager.read()
        if loaded is None:
            return train(trainer, *args, **kwargs)
        state = state_of(loaded, TRAINER_STATE)
        if state is None:
            raise ValueError(f"the checkpoint of step {loaded.record.step} holds no Trainer state")
        self.manager.register(model=trainer.model)
        self.manager.apply(loaded, ["model"])
        self._loaded = loaded
        self._saved = self.restored_step = loaded.record.step
        folder = tempfile.mkdtemp(prefix="smartckpt-resume-")
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            json.dump(state, f)
        trainer._load_from_checkpoint = lambda *a, **k: None  # weights loaded above
        trainer._load_rng_state = lambda _folder: self.manager.apply(loaded, ["rng"])
        logger.info("resuming the Trainer at global step %d", loaded.record.step)
        try:
            kwargs.pop("resume_from_checkpoint", None)
            return train(trainer, folder, *args[1:], **kwargs)
        finally:
            del trainer._load_from_checkpoint, trainer._load_rng_state
            shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.trainer is None:
            raise RuntimeError(
                "SmartCheckpointCallback must be attached: SmartCheckpointCallback(...).attach(trainer)"
            )
        mgr = self.manager
        total_steps(getattr(state, "max_steps", None))
        objects = {
            "model": kw["model"],
            "optimizer": _unwrap(kw["optimizer"], "optimizer"),
            "scheduler": _unwrap(kw["lr_scheduler"], "scheduler"),
        }
        mgr.register(**{k: v for k, v in objects.items() if v is not None})
        mgr.register(**{TRAINER_STATE: StateFn(lambda: dataclasses.asdict(state))})
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            mgr.apply(loaded, [n for n in ("optimizer", "scheduler") if objects[n] is not None])

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loss, self._loss = self._loss, None  # the next step's micro-steps sum afresh
        if self.manager.step(state.global_step, loss=loss).saved:
            self._saved = state.global_step
        if not self.keep_trainer_saves:
            control.should_save = False

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.keep_trainer_saves:
            control.should_save = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        mgr = self.manager
        if mgr is None:
            return
        if self._saved != state.global_step:
            mgr.save(state.global_step, reason="final", blocking=True)
            self._saved = state.global_step
        if self._own:  # a manager the caller handed in stays open for them
            mgr.close()
            self.manager = None
        else:
            mgr.wait()


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate's AcceleratedOptimizer/AcceleratedScheduler hold the real one as ``.optimizer`` /
    ``.scheduler``; the optimizer hooks and the state live there."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and hasattr(inner, "state_dict") else obj
