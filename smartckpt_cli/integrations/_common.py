"""What the framework callbacks share: building their CheckpointManager, state adapters, and reading
one object's state out of a loaded checkpoint without applying it anywhere."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["Holder", "StateFn", "build_manager", "state_of"]

logger = logging.getLogger(__name__)


class StateFn:
    """``state_dict``/``load_state_dict`` from two callables (framework state that is not an object
    with those methods itself: a TrainerState, Lightning's loop progress)."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None] | None = None) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, state: Any) -> None:
        if self._put is not None:
            self._put(state)


class Holder:
    """Receives a state in ``load_state_dict`` and keeps it (see :func:`state_of`)."""

    def __init__(self, like: Any = None) -> None:
        self.value: Any = like
        self.loaded = False

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value, self.loaded = state, True


def state_of(loaded: Any, name: str) -> Any:
    """The state saved under ``name`` in a loaded checkpoint (None when it has none): applied to a
    :class:`Holder`, through the same checks as every restore."""
    from smartckpt_cli.state.apply import apply_checkpoint

    if name not in loaded.manifest.get("objects", {}):
        return None
    holder = Holder()
    apply_checkpoint(loaded, {name: ("state", holder)})
    return holder.value


def build_manager(manager: Any, directory: str | os.PathLike[str] | None, settings: dict[str, Any]) -> Any:
    """The manager a callback uses: the one it was given, else one built from the settings
    (``./smartckpt.yaml``, ``SMARTCKPT_CONFIG``, ``SMARTCKPT_*``; under ``smartckpt run`` these
    carry ``--dir`` and ``--every``), with the callback's own arguments on top."""
    if manager is not None:
        return manager
    from smartckpt_cli.engine.manager import CheckpointManager

    config = os.environ.get("SMARTCKPT_CONFIG") or None
    return CheckpointManager(directory, config=config, **settings)
