"""smartckpt: adaptive, tiered, verified checkpointing for PyTorch training.

Importing the package is cheap and never imports torch: the names that need it
(``CheckpointManager``, ``start_step``…) load their module on first use (PEP 562), so the
operators' commands and the ``smartckpt run`` supervisor stay small and fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from smartckpt_cli.config import Settings, load_settings
from smartckpt_cli.errors import (
    CheckpointCorrupt,
    ConfigError,
    JournalError,
    NoCheckpointError,
    NotAStoreError,
    SmartckptError,
    StateMismatchError,
    StoreLockedError,
    StoreNotFoundError,
)
from smartckpt_cli.version import __version__

if TYPE_CHECKING:
    from smartckpt_cli.agent.carry import carry
    from smartckpt_cli.agent.runtime import start_step
    from smartckpt_cli.engine.manager import CheckpointManager, SaveHandle, StepResult
    from smartckpt_cli.trigger.scores import seed_score

# name -> module that defines it, imported on first access
_LAZY = {
    "CheckpointManager": "smartckpt_cli.engine.manager",
    "SaveHandle": "smartckpt_cli.engine.manager",
    "StepResult": "smartckpt_cli.engine.manager",
    "carry": "smartckpt_cli.agent.carry",
    "start_step": "smartckpt_cli.agent.runtime",
    "seed_score": "smartckpt_cli.trigger.scores",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'smartckpt_cli' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointCorrupt",
    "CheckpointManager",
    "ConfigError",
    "JournalError",
    "NoCheckpointError",
    "NotAStoreError",
    "SaveHandle",
    "Settings",
    "SmartckptError",
    "StateMismatchError",
    "StepResult",
    "StoreLockedError",
    "StoreNotFoundError",
    "__version__",
    "carry",
    "load_settings",
    "seed_score",
    "start_step",
]
