"""smartckpt: adaptive, tiered, verified checkpointing for PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"

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
from smartckpt_cli.manager import CheckpointManager, SaveHandle, StepResult
from smartckpt_cli.runtime import start_step
from smartckpt_cli.trigger import seed_score

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
    "load_settings",
    "seed_score",
    "start_step",
]
