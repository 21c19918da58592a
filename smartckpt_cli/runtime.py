"""What runs inside the training process when smartckpt is injected (``smartckpt run``).

For now this holds the process-wide manager that ``start_step`` restores through; the zero-code
hooks that create it come with ``smartckpt run``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["active_manager", "set_active_manager", "start_step"]

_active: Any = None


def set_active_manager(manager: Any) -> None:
    global _active
    _active = manager


def active_manager() -> Any:
    return _active


def start_step() -> int:
    """The step to start a plain loop from: the restored step under an active manager, else 0."""
    if _active is None:
        return 0
    return int(_active.restore())
