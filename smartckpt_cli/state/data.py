"""Data position for a plain ``torch.utils.data.DataLoader``: resume at the exact next batch.

A DataLoader has no ``state_dict``. What fixes the order of an epoch is the state of its random
generator(s) when the epoch's iterator is created (``DataLoader(generator=...)`` or the sampler's
own ``generator``), plus a ``DistributedSampler``'s epoch. :class:`LoaderState` records those at
each ``iter(loader)`` and counts the batches handed to the training loop. On restore, the next
``iter(loader)`` puts the generators back to the epoch's start and skips the consumed batches at
the *index* level (no sample is loaded twice), so the following batch is the one an uninterrupted
run would have seen. ``torchdata``'s ``StatefulDataLoader`` has its own ``state_dict`` and is used
as is.

Without a seeded generator the shuffling draws from the global torch RNG when the epoch starts;
that order cannot be replayed, so a warning says so at registration.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["LoaderState"]

logger = logging.getLogger(__name__)


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    for g in [loader.generator, *(getattr(s, "generator", None) for s in samplers)]:
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _dist_samplers(loader: DataLoader[Any]) -> list[Any]:
    samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    return [s for s in samplers if s is not None and hasattr(s, "set_epoch") and hasattr(s, "epoch")]


class _SkipOnce:
    """Wraps the index sampler so its first iteration skips ``n`` batches, then passes through
    (a persistent-workers iterator keeps this object and re-iterates it every epoch)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __iter__(self) -> Iterator[Any]:
        n, self.n = self.n, 0
        return itertools.islice(iter(self.inner), n, None)

    def __len__(self) -> int:
        return len(self.inner)


class _Counting:
    def __init__(self, it: Any, tracker: LoaderState) -> None:
        self._it, self._tracker = it, tracker

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._tracker.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


_tracked_classes: dict[type, type] = {}


def _tracked_class(cls: type) -> type:
    """A subclass of the loader's class whose ``__iter__`` records the epoch start (special
    methods are looked up on the type, so the instance's class is swapped, not patched)."""
    if cls not in _tracked_classes:

        def __iter__(self: Any) -> Any:
            tracker: LoaderState = self._smartckpt_tracker
            base_iter: Any = cls.__iter__  # type: ignore[attr-defined]
            return tracker._start_epoch(lambda: base_iter(self))

        def _index_sampler(self: Any) -> Any:
            inner = cls._index_sampler.fget(self)  # type: ignore[attr-defined]
            skip = self._smartckpt_tracker._take_skip()
            return _SkipOnce(inner, skip) if skip else inner

        _tracked_classes[cls] = type(
            f"SmartckptTracked{cls.__name__}",
            (cls,),
            {"__iter__": __iter__, "_index_sampler": property(_index_sampler)},
        )
    return _tracked_classes[cls]


class LoaderState:
    """``state_dict``/``load_state_dict`` for a plain DataLoader (see module docstring). Use
    :meth:`of`: a loader is tracked once, however many managers register it."""

    @classmethod
    def of(cls, loader: DataLoader[Any]) -> LoaderState:
        """The loader's tracker, made on first use. A second tracker would swap the loader's
        class again and count every batch twice (a resume would skip twice as many)."""
        tracker = getattr(loader, "_smartckpt_tracker", None)
        return tracker if isinstance(tracker, LoaderState) else cls(loader)

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.epochs = 0  # iterators created so far
        self.batches = 0  # batches handed out by the current iterator
        self._epoch_start: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        self._skip = 0
        self._creating = False
        if not _generators(loader) and not _dist_samplers(loader) and _shuffles(loader):
            logger.warning(
                "DataLoader shuffles without a seeded generator: the data order after a resume will "
                "differ; pass generator=torch.Generator().manual_seed(SEED) to DataLoader"
            )
        loader._smartckpt_tracker = self
        loader.__class__ = _tracked_class(type(loader))

    def _take_skip(self) -> int:
        # Only the iterator being created gets the skip; len(loader) also reads _index_sampler.
        if not self._creating:
            return 0
        skip, self._skip = self._skip, 0
        return skip

    def _start_epoch(self, make_iter: Any) -> Any:
        resume, self._pending = self._pending, None
        if resume is not None:
            for g, st in zip(_generators(self.loader), resume["generators"], strict=False):
                g.set_state(st)
            for s, ep in zip(_dist_samplers(self.loader), resume["sampler_epochs"], strict=False):
                s.set_epoch(ep)
            self._skip = int(resume["batches"])
        self._epoch_start = {
            "generators": [g.get_state() for g in _generators(self.loader)],
            "sampler_epochs": [int(s.epoch) for s in _dist_samplers(self.loader)],
        }
        self.epochs = resume["epochs"] if resume is not None else self.epochs + 1
        self.batches = self._skip
        self._creating = True
        try:
            it = make_iter()
        finally:
            self._creating = False
            self._skip = 0
        return _Counting(it, self)

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # restored but not iterated yet: keep what was restored
            return dict(self._pending)
        if self._epoch_start is None:
            return {"epochs": 0, "batches": 0, "generators": [], "sampler_epochs": [], "started": False}
        return {"epochs": self.epochs, "batches": self.batches, "started": True, **self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state) if state.get("started") else None
        if self._pending is not None:
            self.epochs = int(state["epochs"])
            self.batches = int(state["batches"])


def _shuffles(loader: DataLoader[Any]) -> bool:
    from torch.utils.data import RandomSampler

    samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    return any(isinstance(s, RandomSampler) for s in samplers)
