"""A save in pieces: the state copied and written through one reusable buffer (engine/budget.py).

When a save may not hold a copy of the whole state (``memory_budget``), the snapshot copies
nothing up front: its items keep their *live* tensor (``Item.live``) and the writer asks
:meth:`Pager.pieces` for them a piece at a time. Each piece is copied into the buffer, written
(every blob durable) and only then is the next copied over it. A tensor larger than a piece is cut
at chunk boundaries (so its manifest entry is the same chunks an unpieced save writes); where it
cannot be cut (a reduced precision, a non-contiguous tensor) it gets a buffer of its own size.

The live tensors must not change until they are copied: the items no optimizer guards come first
and the save call waits for them (``Snapshot.early``); the parameters and moments the optimizers
update come last and their optimizer step waits for them (``Snapshot.copied``), as on the lazy path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from smartckpt_cli.engine.hostmem import host_buffer

__all__ = ["Pager"]

logger = logging.getLogger(__name__)

_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Pager:
    """One reusable host buffer of ``piece`` bytes (pinned on CUDA) and the cutting of a save's
    deferred items into pieces that fit it."""

    def __init__(self, piece: int, chunk_bytes: int) -> None:
        self.piece, self.chunk_bytes = piece, chunk_bytes
        self._buf: torch.Tensor | None = None
        self._stream: Any = None

    def _buffer(self, pin: bool) -> torch.Tensor:
        if self._buf is None:
            self._buf = host_buffer(torch.Size([self.piece]), torch.uint8, pin)
        return self._buf

    def _parts(self, item: Any) -> list[tuple[Any, int, int]]:
        """(item, first byte, end byte) of the live tensor: cut at chunk steps where it is larger
        than a piece and its bytes are stored as they are."""
        n = item.nbytes
        live = item.live
        if n <= self.piece or item.plan.transform != "none" or not live.is_contiguous():
            return [(item, 0, n)]
        size = live.element_size()
        step = max(size, self.chunk_bytes - self.chunk_bytes % size)
        span = max(step, self.piece // step * step)
        return [(item, a, min(n, a + span)) for a in range(0, n, span)]

    def pieces(self, snap: Any, items: list[Any]) -> Iterator[list[Any]]:
        """``items`` (deferred: ``live`` set) as lists of items whose ``tensor`` holds their
        bytes, one list per piece; a part of a cut tensor is an item with a flat ``tensor`` and
        the whole tensor's ``shape``. The caller writes a piece before asking for the next (the
        buffer is refilled). ``snap.early`` is set once the unguarded items are copied,
        ``snap.copied`` once all are (also when this stops early: the loop never waits forever)."""
        try:
            first = [it for it in items if not it.guarded]
            rest = [it for it in items if it.guarded]
            head = [p for it in first for p in self._parts(it)]
            parts, n_first = head + [p for it in rest for p in self._parts(it)], len(head)
            if not first:
                snap.early.set()
            pending: list[tuple[Any, int, int]] = []
            used = 0
            for i, (item, a, b) in enumerate(parts):
                if pending and used + _align(b - a) > self.piece:
                    yield self._copy(snap, pending)
                    pending, used = [], 0
                pending.append((item, a, b))
                used += _align(b - a)
                if i + 1 == n_first:  # the unguarded ones end here: the save call waits for no more
                    piece = self._copy(snap, pending, last=i + 1 == len(parts))
                    snap.early.set()
                    pending, used = [], 0
                    yield piece
            if pending:
                yield self._copy(snap, pending, last=True)
        finally:
            snap.early.set()
            snap.copied.set()

    def _copy(self, snap: Any, parts: list[tuple[Any, int, int]], last: bool = False) -> list[Any]:
        cuda = any(item.live.device.type == "cuda" for item, _, _ in parts)
        total = sum(_align(b - a) for _, a, b in parts)
        buf = self._buffer(cuda) if total <= self.piece else None
        if buf is None:  # one tensor that cannot be cut, larger than a piece: a buffer of its own
            buf = host_buffer(torch.Size([total]), torch.uint8, cuda)
            logger.debug("a piece of %d bytes (above %d): %s", total, self.piece, parts[0][0].plan.key)
        stream = None
        if cuda:  # a side stream: the save thread's copies never queue behind training's kernels
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            if snap.ready is not None:  # after the training stream produced the values
                stream.wait_event(snap.ready)
        out, off = [], 0
        for item, a, b in parts:
            live = item.live.detach()
            whole = a == 0 and b == item.nbytes
            dst = buf[off : off + (b - a)].view(item.dtype)
            if whole:
                dst = dst.view(item.live.shape)
                src = live
            else:
                src = live.reshape(-1).view(torch.uint8)[a:b].view(item.dtype)
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            out.append(replace(item, tensor=dst, live=None, part=None if whole else a))
            off += _align(b - a)
        if stream is not None:
            stream.synchronize()
        if last:
            snap.copied.set()  # the buffer holds the last piece: the optimizer may go on
        return out
