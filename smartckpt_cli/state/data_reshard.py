"""The data position of a ``DistributedSampler`` epoch carried to another world size (pure functions).

A ``DistributedSampler``'s epoch has one *global order*, a function of seed and epoch only
(:func:`epoch_order`). A *dealing* hands a run of that order to ``world`` ranks: the run is padded
to a multiple of ``world`` by repeating its first samples (truncated to one if ``drop_last``) and
rank ``r`` takes ``run[r::world]`` (:func:`deal`); a plain ``DistributedSampler`` is the dealing of
the whole order. A dealing that started at position ``prefix`` and in which every rank consumed
``samples`` samples has consumed the first ``min(len, prefix + world * samples)`` positions
(:func:`consumed_positions`); the rest of the epoch is dealt afresh to the new world
(:func:`remainder_indices`). Nothing here needs ``torch.distributed``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["batches_of", "consumed_positions", "deal", "dealt_len", "epoch_order", "remainder_indices"]


def epoch_order(order_len: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global order of an epoch, exactly as ``DistributedSampler.__iter__`` draws it."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.randperm(order_len, generator=g).tolist()
    return list(range(order_len))


def dealt_len(run_len: int, world: int, drop_last: bool) -> int:
    """Samples per rank when a run of ``run_len`` positions is dealt to ``world`` ranks."""
    if drop_last and run_len % world != 0:
        return math.ceil((run_len - world) / world)
    return math.ceil(run_len / world)


def deal(run: list[int], world: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s share of ``run`` dealt to ``world`` ranks: DistributedSampler's own padding
    (the run's first samples repeated) or truncation, then every ``world``-th position."""
    total = dealt_len(len(run), world, drop_last) * world
    # Padded with its first samples, repeated as often as needed; or truncated.
    copies = math.ceil(total / len(run)) if run and not drop_last else 1
    run = (run * copies)[:total]
    return run[rank:total:world]


def consumed_positions(order_len: int, prefix: int, world: int, samples: int, drop_last: bool) -> int:
    """Positions of the global order consumed once each of ``world`` ranks took ``samples`` samples
    of the dealing that started at ``prefix``. A rank that finished its share finished the epoch
    (the tail a ``drop_last`` dealing leaves out is not owed)."""
    if samples >= dealt_len(order_len - prefix, world, drop_last):
        return order_len
    return min(order_len, prefix + world * samples)


def remainder_indices(
    order_len: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    prefix: int,
    old_world: int,
    per_rank_samples: int,
    new_world: int,
    new_rank: int,
    drop_last: bool,
    old_drop_last: bool | None = None,
) -> list[int]:
    """Rank ``new_rank`` of ``new_world``'s indices for the rest of the epoch, after ``old_world``
    ranks each consumed ``per_rank_samples`` samples of the dealing that started at ``prefix``.
    ``drop_last`` is the new dealing's (the live sampler's); ``old_drop_last`` the old one's
    (default: the same). Every new rank gets the same number of indices."""
    old_dl = drop_last if old_drop_last is None else old_drop_last
    start = consumed_positions(order_len, prefix, old_world, per_rank_samples, old_dl)
    return deal(epoch_order(order_len, seed, epoch, shuffle)[start:], new_world, new_rank, drop_last)


def batches_of(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """``indices`` cut into batches as a ``BatchSampler`` cuts them."""
    out = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out
