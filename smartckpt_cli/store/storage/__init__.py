"""Storage backends: where bytes go. They know nothing of checkpoints or policy; they refuse any
name that would leave their root. Everything outside this package uses :class:`Storage`, and
gets one from :func:`open_storage` (a URL) or constructs :class:`LocalStorage` (a directory),
never the backend's internals."""

from smartckpt_cli.store.storage.base import Pending, Storage
from smartckpt_cli.store.storage.limiter import Limiter
from smartckpt_cli.store.storage.local import LocalStorage
from smartckpt_cli.store.storage.open import is_url, open_storage

__all__ = ["Limiter", "LocalStorage", "Pending", "Storage", "is_url", "open_storage"]
