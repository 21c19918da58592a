"""Storage backends: where bytes go. They know nothing of checkpoints or policy; they refuse any
name that would leave their root. Everything outside this package uses :class:`Storage` (and
constructs :class:`LocalStorage`), never the backend's internals."""

from smartckpt_cli.store.storage.base import Pending, Storage
from smartckpt_cli.store.storage.local import LocalStorage

__all__ = ["LocalStorage", "Pending", "Storage"]
