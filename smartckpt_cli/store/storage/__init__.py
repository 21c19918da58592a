"""Storage backends: where bytes go. They know nothing of checkpoints or policy."""

from smartckpt_cli.store.storage.base import Storage
from smartckpt_cli.store.storage.local import LocalStorage, file_lock

__all__ = ["LocalStorage", "Storage", "file_lock"]
