"""Scrubbing reused blobs: bit rot in shared chunks is found while the live state can still
rewrite them.

Deduplication reuses a blob because its file exists. One bit-rotted chunk of frozen weights would
then be referenced by every later checkpoint, and they would all fail verification together,
long after the live tensor that could repair it changed or the run ended. So each save re-hashes
a bounded share of the blobs it reuses (:class:`Scrubber`): a byte budget per save — as many
bytes as the previous save wrote new, at least :data:`MIN_BYTES` — spent on blobs not checked in
the current *rotation*; when every reused blob has been checked, a new rotation starts. A reused
blob that fails is written again from the live tensor (its content is known: its raw hash matched)
and reported.

When each blob was last found sound is kept in ``<meta_dir>/scrub.json`` (:class:`ScrubBook`,
written whole after each save that checked something; ``smartckpt verify`` adds to it), so
``inspect`` can show, per checkpoint, its least recently checked blob.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from smartckpt_cli.store.names import is_blob_id
from smartckpt_cli.store.storage.base import Storage

__all__ = ["BOOK", "MIN_BYTES", "ScrubBook", "Scrubber", "book_name"]

logger = logging.getLogger(__name__)

BOOK = "scrub.json"
MIN_BYTES = 64 << 20  # re-hashed per save at least (when that much is reused)
_VERSION = 1


def book_name(rank: int) -> str:
    """Each rank scrubs the blobs of its own part, and keeps its own book."""
    return BOOK if rank == 0 else f"scrub-r{rank}.json"


class ScrubBook:
    """When each blob was last found sound (epoch seconds), in ``meta_dir``. Best effort: an
    unreadable book starts empty; a book that cannot be written is tried again next time."""

    def __init__(self, meta: Storage, rank: int = 0) -> None:
        self.meta = meta
        self.name = book_name(rank)
        self.checked: dict[str, float] = {}
        try:
            data = json.loads(meta.read(self.name))
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("v") == _VERSION and isinstance(data.get("checked"), dict):
            self.checked = {
                b: float(t)
                for b, t in data["checked"].items()
                if is_blob_id(b) and isinstance(t, int | float) and not isinstance(t, bool)
            }

    def mark(self, bids: list[str], when: float | None = None) -> None:
        now = time.time() if when is None else when
        for bid in bids:
            self.checked[bid] = now

    def save(self, keep: set[str] | None = None) -> None:
        """Write the book (only ``keep``'s blobs when given: the ones still in the store)."""
        checked = self.checked if keep is None else {b: t for b, t in self.checked.items() if b in keep}
        try:
            self.meta.write(
                self.name, json.dumps({"v": _VERSION, "checked": checked}, sort_keys=True).encode()
            )
        except OSError as err:
            logger.debug("%s not written: %s", self.name, err)

    def oldest(self, bids: list[str]) -> float | None:
        """The least recent check among ``bids`` (None when one was never checked)."""
        times = [self.checked.get(b) for b in bids]
        if not times or any(t is None for t in times):
            return None
        return min(t for t in times if t is not None)


class Scrubber:
    """The writer's side (thread-safe: the encoding pool calls :meth:`wants` concurrently)."""

    def __init__(self, book: ScrubBook, min_bytes: int = MIN_BYTES) -> None:
        self.book = book
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._rotation: set[str] = set()  # checked in this rotation
        self._budget = min_bytes
        self._offered = 0  # reused blobs offered in this save that were already checked
        self._checked: list[str] = []
        self.repaired: list[str] = []

    def begin_save(self, last_bytes_new: int) -> None:
        with self._lock:
            self._budget = max(self.min_bytes, last_bytes_new)
            self._offered = 0
            self._checked = []
            self.repaired = []

    def wants(self, bid: str, size: int) -> bool:
        """Whether to re-hash this reused blob now (its bytes count against the budget)."""
        with self._lock:
            if bid in self._rotation:
                self._offered += 1
                return False
            if self._budget <= 0:
                return False
            self._budget -= size
            self._rotation.add(bid)
            return True

    def checked(self, bid: str, sound: bool) -> None:
        with self._lock:
            if sound:
                self._checked.append(bid)
            else:
                self.repaired.append(bid)

    def end_save(self) -> dict[str, Any]:
        """What this save did; a rotation ends when the save found nothing left to check."""
        with self._lock:
            done, repaired = list(self._checked), list(self.repaired)
            if not done and not repaired and self._offered:
                self._rotation.clear()  # every reused blob was checked: start over
        if done or repaired:
            self.book.mark(done + repaired)
            self.book.save()
        return {"checked": len(done), "repaired": repaired}
