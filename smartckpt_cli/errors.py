"""One exception family for everything smartckpt refuses to do.

Domain code raises these; only the CLI turns them into exit codes (``exit_code``), so a user
sees one line naming the problem instead of a traceback.
"""

from __future__ import annotations

__all__ = [
    "EXIT_ERROR",
    "EXIT_REMOTE_UNREACHABLE",
    "EXIT_USAGE",
    "CheckpointCorrupt",
    "ConfigError",
    "JournalError",
    "JournalTooNewError",
    "NoCheckpointError",
    "NotAStoreError",
    "NothingCheckpointedError",
    "RemoteStartRefused",
    "SmartckptError",
    "StateMismatchError",
    "StoreDamagedError",
    "StoreLockedError",
    "StoreNotFoundError",
    "UnsafePathError",
    "UnsupportedValueError",
    "UsageError",
]

EXIT_ERROR = 1  # the operation failed (a corrupt checkpoint, no usable checkpoint, ...)
EXIT_USAGE = 2  # bad input: a missing directory, a wrong flag, a bad config key


class SmartckptError(Exception):
    """Base class; ``str(err)`` is the one line shown to the user."""

    exit_code: int = EXIT_ERROR


class ConfigError(SmartckptError):
    exit_code = EXIT_USAGE


class UsageError(SmartckptError):
    """A command's arguments do not fit the store (a step that does not exist, nothing to undo)."""

    exit_code = EXIT_USAGE


class StoreNotFoundError(SmartckptError):
    exit_code = EXIT_USAGE


class NotAStoreError(SmartckptError):
    exit_code = EXIT_USAGE


class JournalError(SmartckptError):
    """The journal cannot be read, or is not a smartckpt journal, or has an unknown version."""


class JournalTooNewError(JournalError):
    """The journal was written by a newer smartckpt (its version is above what this one reads)."""


class StoreDamagedError(JournalError):
    """The journal cannot be read, or is missing or empty while manifests no journal line names
    are there (store/unjournalled.py): nothing writes to the store until ``smartckpt verify
    --repair`` rebuilds the journal, or the store is moved away."""


class StoreUnreachableError(SmartckptError):
    """A store named by a URL cannot be reached or read (the object store is down, refuses)."""


class StoreLockedError(SmartckptError):
    """Another process already writes to this checkpoint store."""


class NoCheckpointError(SmartckptError):
    """No committed checkpoint could be restored."""


class NothingCheckpointedError(SmartckptError):
    """A directory that ``smartckpt run`` used (it holds run records) but where no checkpoint was
    ever committed: ``inspect``, ``verify`` and ``plot`` have nothing to read (exit 1)."""


class CheckpointCorrupt(SmartckptError):
    """A checkpoint failed verification (missing blob, hash mismatch, undecodable chunk...)."""

    def __init__(self, message: str, *, tier: str | None = None) -> None:
        super().__init__(message)
        self.tier = tier


class RemoteStartRefused(SmartckptError):
    """Nothing to resume locally and the remote tier unreachable for ``remote_start_wait``: the run
    does not start over at step 0 (its checkpoints may be on the remote). ``smartckpt run`` stops
    with :data:`EXIT_REMOTE_UNREACHABLE`."""


EXIT_REMOTE_UNREACHABLE = 5


class UnsafePathError(SmartckptError, OSError):
    """A path a backend refuses because it would leave its root: a name that is absolute, holds
    ``..`` or characters no smartckpt name has, or a symlink inside the store pointing outside.
    An ``OSError`` too, so every reader that already treats an unreadable file as damage (skip the
    checkpoint, fall back to the previous one) treats this one the same way."""


class StateMismatchError(SmartckptError):
    """A checkpoint does not fit the registered objects (shape, dtype, missing keys)."""

    exit_code = EXIT_USAGE


class UnsupportedValueError(SmartckptError):
    """A state value that cannot be stored without pickle."""

    exit_code = EXIT_USAGE
