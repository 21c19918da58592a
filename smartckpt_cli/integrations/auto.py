"""Under ``smartckpt run``: every Hugging Face or Lightning Trainer gets smartckpt's callback.

``hooks/sitecustomize.py`` calls :func:`patch` with the trainer module right after it has been
imported (``transformers.trainer``, ``pytorch_lightning.trainer.trainer`` or
``lightning.pytorch.trainer.trainer``). The Trainer class's ``__init__`` is wrapped: after it ran,
a Trainer without a smartckpt callback gets one (marked ``auto``; one the script attaches itself
replaces it). The callback's CheckpointManager turns zero-code mode off in that process, so the
optimizer hooks do not checkpoint the same training a second time.

Every rank adds it, whatever the world size: the decision must be the same on every rank (the
callbacks run collectives), and a fact only some ranks have is no ground for it — Lightning's
``strategy="ddp"`` starts ranks 1..N itself *after* rank 0 built its Trainer, so ``WORLD_SIZE``
is not yet set on rank 0 when its Trainer is made. The callback's manager coordinates the ranks
once torch.distributed runs (engine/coordinator.py).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

__all__ = ["patch"]

logger = logging.getLogger(__name__)

_PATCHED = "_smartckpt_patched"


def patch(module: Any) -> None:
    """Wrap ``module.Trainer.__init__`` (once) so each new Trainer gets the callback."""
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls.__init__, _PATCHED, False):
        return
    add = _add_hf if module.__name__.startswith("transformers") else _add_lightning
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            add(self)
        except Exception as err:  # never break the user's Trainer: it runs without smartckpt
            print(f"smartckpt: Trainer callback not added ({type(err).__name__}: {err})", file=sys.stderr)

    setattr(__init__, _PATCHED, True)
    cls.__init__ = __init__


def _add_hf(trainer: Any) -> None:
    from smartckpt_cli.integrations.hf import SmartCheckpointCallback

    mine = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SmartCheckpointCallback)]
    if mine:
        if mine[0].trainer is None:
            mine[0].attach(trainer)  # given in callbacks=[...]: attach it for the resume
        return
    SmartCheckpointCallback(auto=True).attach(trainer)
    logger.info("smartckpt: checkpointing this Trainer (callback added by smartckpt run)")


def _add_lightning(trainer: Any) -> None:
    from smartckpt_cli.integrations.lightning import SmartCheckpointCallback

    if any(isinstance(cb, SmartCheckpointCallback) for cb in trainer.callbacks):
        return
    SmartCheckpointCallback(auto=True).attach(trainer)
    logger.info("smartckpt: checkpointing this Trainer (callback added by smartckpt run)")
