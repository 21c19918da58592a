"""Data position for a plain ``torch.utils.data.DataLoader``: resume at the exact next batch.

A DataLoader has no ``state_dict``. What fixes the order of an epoch is the state of its random
generator(s) when the epoch's iterator is created (``DataLoader(generator=...)`` or the sampler's
own ``generator``), plus a ``DistributedSampler``'s epoch. :class:`LoaderState` records those at
each ``iter(loader)`` and counts the batches handed to the training loop. On restore, the next
``iter(loader)`` puts the generators back to the epoch's start and skips the consumed batches at
the *index* level (no sample is loaded twice), so the following batch is the one an uninterrupted
run would have seen. ``torchdata``'s ``StatefulDataLoader`` has its own ``state_dict`` and is used
as is (at another world size it is not loaded: :func:`load_stateful_loader`).

With a ``DistributedSampler`` the state also records the *data position* in samples of the epoch's
global order (see :mod:`smartckpt_cli.state.data_reshard`). Loaded on a rank of another world size,
the next ``iter(loader)`` hands this rank its share of the rest of the epoch, cut into the live
loader's batches (:mod:`smartckpt_cli.state.data_carry` plans it); the epochs after it are the
live sampler's own. At the same world size (and the same batch size) the exact path above is kept.

Without a generator of its own a loader draws from the *global* torch RNG when an epoch starts:
its iterator's base seed (the workers' seeds) and a ``RandomSampler``'s permutation seed. Those
draws are part of the data position: the global RNG state before them is recorded at each epoch
start, and the iterator a resumed run creates (after ``restore()`` put the RNG back to the
checkpoint's state) makes them again from that recorded state, its first batch fetched there,
and then puts the RNG back to the checkpoint's state. The epoch is then the same permutation
with the same worker seeds, and the training's own draws (dropout) continue exactly where the
checkpoint left them: as if the iterator had been created before the interruption, as it was.

A checkpoint taken once an epoch's last batch was handed out resumes at the *next* epoch's start,
the way a loop counts it: a loop ``for epoch in range(start // batches_per_epoch, epochs)`` then
gets that epoch's batches, not an empty remainder of the finished one. The finished epoch's
draws from the loader's own generators are made again first (its iterator's base seed, then its
whole index order: ``RandomSampler`` draws once more when its epoch ends, after the last batch),
without loading a sample. ``lookahead``: batches the loader's user fetches ahead of what it hands
out (accelerate's prepared loaders: state/wrappers.py), not counted as consumed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.state.data_carry import fresh_dealing, live_world, loader_batch_size, plan_carry
from smartckpt_cli.state.data_reshard import batches_of, dealt_len

__all__ = ["LoaderState", "load_stateful_loader"]

logger = logging.getLogger(__name__)


def _samplers(loader: DataLoader[Any]) -> list[Any]:
    """The loader's samplers, wrapped ones included (accelerate's ``BatchSamplerShard`` holds the
    loader's batch sampler as ``.batch_sampler``, which holds the ``RandomSampler``)."""
    found: list[Any] = []
    todo = [loader.sampler, loader.batch_sampler]
    while todo and len(found) < 16:
        s = todo.pop(0)
        if s is None or any(s is f for f in found):
            continue
        found.append(s)
        todo += [getattr(s, "sampler", None), getattr(s, "batch_sampler", None)]
    return found


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    for g in [loader.generator, *(getattr(s, "generator", None) for s in _samplers(loader))]:
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _dist_samplers(loader: DataLoader[Any]) -> list[Any]:
    return [s for s in _samplers(loader) if hasattr(s, "set_epoch") and hasattr(s, "epoch")]


class _FirstIteration:
    """Wraps the index sampler so the iterator being created skips ``skip`` batches, or yields
    ``items`` (the rest of an epoch carried from another dealing) instead; once it is created the
    wrapper is disarmed and passes through (a persistent-workers iterator keeps this object and
    re-iterates it every epoch). Armed for the whole creation, not for one ``iter``: a
    multiprocessing iterator iterates its index sampler twice while it is created (in its base
    ``__init__`` and in its first ``_reset``)."""

    def __init__(self, inner: Any, skip: int, items: list[Any] | None) -> None:
        self.inner, self.skip, self.items, self.armed = inner, skip, items, True
        self._len: int | None = None if items is None else len(items)

    def __iter__(self) -> Iterator[Any]:
        self._len = None
        if not self.armed:
            return iter(self.inner)
        if self.items is not None:
            self._len = len(self.items)
            return iter(self.items)
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner) if self._len is None else self._len


def _identity(loader: DataLoader[Any]) -> dict[str, Any]:
    """What the position means only for: the dataset's length and the sampler's kind."""
    out: dict[str, Any] = {}
    try:
        out["dataset_len"] = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without a length
        pass
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    inner = getattr(sampler, "sampler", None)
    out["sampler"] = type(sampler).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    return out


def _check_identity(state: dict[str, Any], loader: DataLoader[Any]) -> None:
    """A position saved for one loader must not be loaded into another: the same dataset length
    and the same kind of sampler, or StateMismatchError (states that do not record them pass)."""
    live = _identity(loader)
    saved_len, live_len = state.get("dataset_len"), live.get("dataset_len")
    if saved_len is not None and live_len is not None and saved_len != live_len:
        raise StateMismatchError(
            f"its dataset has {live_len} samples, the checkpoint's loader had {saved_len}: another dataset"
        )
    saved_sampler = state.get("sampler")
    if saved_sampler is not None and saved_sampler != live["sampler"]:
        raise StateMismatchError(
            f"its sampler is {live['sampler']}, the checkpoint's loader had {saved_sampler}"
        )


class _Counting:
    """The loader's iterator, counting the batches it hands out. ``first``: a batch fetched ahead,
    while the iterator was created on resume (``LoaderState._replay``), handed out first;
    ``done``: the iterator ended while that batch was fetched."""

    _NOTHING = object()

    def __init__(self, it: Any, tracker: LoaderState, first: Any = _NOTHING, done: bool = False) -> None:
        self._it, self._tracker, self._first, self._done = it, tracker, first, done

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        if self._first is not _Counting._NOTHING:
            batch, self._first = self._first, _Counting._NOTHING
        elif self._done:
            self._tracker._exhausted = True
            raise StopIteration
        else:
            try:
                batch = next(self._it)
            except StopIteration:
                self._tracker._exhausted = True  # this rank finished its share (a dropped last batch too)
                raise
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
            return self._smartckpt_tracker._wrap_index_sampler(inner)

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
        # Data position (DistributedSampler only): the current iterator's dealing, the samples of
        # it consumed before this iterator, and its length per rank.
        self._dealing: dict[str, Any] | None = None
        self._base = 0
        self._dealt = 0
        self._world = 1
        self._carry: dict[str, Any] | None = None  # planned by load_state_dict, used by the next iter
        self._remainder: list[Any] | None = None
        self._wrapper: _FirstIteration | None = None  # the index sampler's, while the iterator is created
        self._reshard_note: str | None = None
        self._exhausted = False
        self.lookahead = 0  # batches its user fetches ahead of what it hands out (module docstring)
        self._total: int | None = None  # batches of the current epoch, when the loader has a length
        loader._smartckpt_tracker = self
        loader.__class__ = _tracked_class(type(loader))

    def _wrap_index_sampler(self, inner: Any) -> Any:
        # Only the iterator being created gets the skip; len(loader) also reads _index_sampler.
        if not self._creating:
            return inner
        if self._wrapper is None and (self._skip or self._remainder is not None):
            self._wrapper = _FirstIteration(inner, self._skip, self._remainder)
        return self._wrapper if self._wrapper is not None else inner

    def _start_epoch(self, make_iter: Any) -> Any:
        resume, self._pending = self._pending, None
        carry, self._carry = self._carry, None
        after = bool(resume.get("next")) if resume is not None and carry is None else False
        if resume is not None and after:
            # the epoch was finished: this is the next one, its generators as the epoch left them
            self._finish_epoch(resume)
            resume = None
            self.epochs += 1
        if resume is not None:
            for g, st in zip(_generators(self.loader), resume["generators"], strict=False):
                g.set_state(st)
            for s, ep in zip(_dist_samplers(self.loader), resume["sampler_epochs"], strict=False):
                s.set_epoch(ep)
            if carry is None:
                self._skip = int(resume["batches"])
        replay = resume.get("global_rng") if resume is not None else None
        self._epoch_start = {
            "generators": [g.get_state() for g in _generators(self.loader)],
            "sampler_epochs": [int(s.epoch) for s in _dist_samplers(self.loader)],
        }
        if self.loader.generator is None:  # its iterator draws from the global RNG (module docstring)
            self._epoch_start["global_rng"] = replay if replay is not None else torch.get_rng_state()
        self._world = live_world(self.loader)
        if carry is not None:
            self._remainder = (
                carry["indices"]
                if self.loader.batch_size is None
                else batches_of(carry["indices"], self.loader.batch_size, self.loader.drop_last)
            )
            self._dealing, self._base, self._dealt = carry["dealing"], carry["base"], carry["dealt"]
        else:
            self._dealing, self._base, self._dealt = fresh_dealing(self.loader), 0, 0
            if self._dealing is not None:
                self._dealt = dealt_len(
                    self._dealing["len"], self._dealing["world"], self._dealing["drop_last"]
                )
        self.epochs = resume["epochs"] if resume is not None else self.epochs + (not after)
        self.batches = self._skip
        self._exhausted = False
        self._creating = True
        try:
            if replay is not None and carry is None:
                return self._replay(make_iter, replay)
            it = make_iter()
        finally:
            self._creating = False
            self._skip, self._remainder = 0, None
            if self._wrapper is not None:
                self._wrapper.armed = False
                self._wrapper = None
        return self._counting(it)

    def _finish_epoch(self, state: dict[str, Any]) -> None:
        """The draws the finished epoch of ``state`` made from the loader's own generators, made
        again from its start: the iterator's base seed, then its whole index order (no sample)."""
        gens = _generators(self.loader)
        if not gens:
            return  # the global RNG's draws are in the restored RNG state already
        for g, st in zip(gens, state["generators"], strict=False):
            g.set_state(st)
        for s, ep in zip(_dist_samplers(self.loader), state["sampler_epochs"], strict=False):
            s.set_epoch(ep)
        if self.loader.generator is not None:
            torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        for _ in self.loader._index_sampler:
            pass

    def _counting(self, it: Any, **first: Any) -> _Counting:
        try:
            self._total = len(it)
        except TypeError:  # an IterableDataset without a length
            self._total = None
        return _Counting(it, self, **first)

    def _replay(self, make_iter: Any, state: torch.Tensor) -> _Counting:
        """The resumed epoch's iterator, made from the global RNG state its epoch began with: the
        base seed and a sampler's seed are drawn again as they were, the first batch fetched
        (the sampler draws at its first index), then the checkpoint's RNG state put back."""
        now = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            it = make_iter()
            try:
                return self._counting(it, first=next(it))
            except StopIteration:
                return self._counting(it, done=True)
        finally:
            torch.set_rng_state(now)

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # restored but not iterated yet: keep what was restored
            return dict(self._pending)
        if self._epoch_start is None:
            return {"epochs": 0, "batches": 0, "generators": [], "sampler_epochs": [], "started": False}
        state = {"epochs": self.epochs, "batches": self.batches, "started": True, **self._epoch_start}
        if self._exhausted or (self._total is not None and self.batches >= self._total):
            state["next"] = True  # finished: a resume begins the next epoch (module docstring)
        elif self.lookahead and self.batches:
            state["batches"] = self.batches - self.lookahead
        state["world"] = self._world
        state.update(_identity(self.loader))
        if self._dealing is not None:
            size = loader_batch_size(self.loader)
            samples = self._dealt if self._exhausted else min(self._dealt, self._base + self.batches * size)
            state["position"] = {**self._dealing, "samples": samples, "base": self._base, "batch_size": size}
        return state

    def load_state_dict(self, state: dict[str, Any], *, world: int | None = None) -> None:
        """Load a state for the next ``iter(loader)``. A state saved at another world size (its
        ``world`` differs from the live ``DistributedSampler``'s ``num_replicas``) carries the data
        position: this rank gets its share of the rest of the epoch. ``world``: the world size the
        checkpoint was written at, for states that do not record it (written before elastic
        resume); without it such a state is taken to be from this world size.

        Raises :class:`~smartckpt_cli.errors.StateMismatchError` when the position cannot move to
        this world size (no ``DistributedSampler``, a user ``batch_sampler``, an old state)."""
        self._reshard_note = None
        started = bool(state.get("started"))
        saved_world = state.get("world", world if world is not None else live_world(self.loader))
        if started and saved_world == live_world(self.loader):
            # The exact path: another dataset or sampler is refused, nothing loaded (another world
            # size follows the elastic rules of plan_carry, which check what they need themselves).
            _check_identity(state, self.loader)
        carry = None
        if started:  # raises before anything changes
            carry, self._reshard_note = plan_carry(self.loader, state, world)
        self._pending, self._carry = (dict(state) if started else None), carry
        if started:
            self.epochs = int(state["epochs"])
            self.batches = int(state["batches"])

    def describe_reshard(self) -> str | None:
        """One line for the log when the last :meth:`load_state_dict` carried the data position to
        another world size, e.g. ``data position carried: epoch 3, 1200 of 5000 samples consumed,
        rest dealt to 4 ranks``; None otherwise."""
        return self._reshard_note


def load_stateful_loader(loader: Any, state: dict[str, Any], *, saved_world: int, world: int) -> str | None:
    """Load a torchdata ``StatefulDataLoader``'s own state, unless the checkpoint was written at
    another world size: its state (a count of samples yielded by *this* rank's sampler) does not
    translate, so it is not loaded and the loader starts the interrupted epoch from its first
    batch. Returns that warning line (also logged), or None when the state was loaded."""
    if saved_world == world:
        loader.load_state_dict(state)
        return None
    line = (
        f"StatefulDataLoader state not loaded: written at {saved_world} rank(s), this run has "
        f"{world}; the interrupted epoch starts again from its first batch"
    )
    logger.warning(line)
    return line
