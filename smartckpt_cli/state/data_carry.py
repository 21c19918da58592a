"""A saved data position read against the live loader: what the next iterator yields instead.

:class:`~smartckpt_cli.state.data.LoaderState` tracks iterators and records positions; this module
decides, once a checkpoint's position is loaded, whether the exact path (skip the consumed batches)
still holds or the rest of the epoch must be dealt afresh (another world size, a dealing that began
mid-epoch, another batch size), and describes the live ``DistributedSampler``'s own dealing. It is
apart because it reads only the loader and the saved state, never the tracker's iterators, and sits
on :mod:`smartckpt_cli.state.data_reshard`'s pure arithmetic.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.state.data_reshard import consumed_positions, deal, epoch_order, remainder_indices

__all__ = ["fresh_dealing", "live_world", "loader_batch_size", "plan_carry"]

_DEALING_KEYS = ("len", "seed", "shuffle", "epoch", "drop_last", "prefix", "world")


def plan_carry(
    loader: DataLoader[Any], state: dict[str, Any], world: int | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The carry for the next iterator: None for the exact path (skip the consumed batches); else
    the rest of the epoch. With it the line for the log when the position moved to another world
    size, else None. Raises StateMismatchError before anything changes."""
    live = live_world(loader)
    saved = state.get("world", world)
    pos = state.get("position")
    if saved is None or int(saved) == live:
        if pos is None or (
            pos["prefix"] == 0 and pos["base"] == 0 and pos["batch_size"] == loader_batch_size(loader)
        ):
            return None, None
        return _continue_dealing(loader, pos, live), None
    return _deal_rest(loader, pos, int(saved), live)


def _continue_dealing(loader: DataLoader[Any], pos: dict[str, Any], live: int) -> dict[str, Any]:
    # Same world, but the dealing started mid-epoch (an earlier elastic resume) or the
    # batch size changed: continue the same dealing, sample by sample.
    ds = _reshardable(loader, pos, int(pos["world"]), live)
    share = deal(
        epoch_order(pos["len"], pos["seed"], pos["epoch"], pos["shuffle"])[pos["prefix"] :],
        int(pos["world"]),
        ds.rank,
        bool(pos["drop_last"]),
    )
    done = min(len(share), int(pos["samples"]))
    dealing = {k: pos[k] for k in _DEALING_KEYS}
    return {
        "indices": share[done:],
        "dealing": {**dealing, "rank": ds.rank},
        "base": done,
        "dealt": len(share),
    }


def _deal_rest(
    loader: DataLoader[Any], pos: dict[str, Any] | None, saved: int, live: int
) -> tuple[dict[str, Any], str]:
    """The rest of the epoch dealt to ``live`` ranks, and the log line saying so."""
    ds = _reshardable(loader, pos, saved, live)
    assert pos is not None
    start = consumed_positions(
        pos["len"], pos["prefix"], pos["world"], pos["samples"], bool(pos["drop_last"])
    )
    indices = remainder_indices(
        pos["len"],
        pos["seed"],
        pos["epoch"],
        bool(pos["shuffle"]),
        pos["prefix"],
        pos["world"],
        pos["samples"],
        live,
        ds.rank,
        ds.drop_last,
        old_drop_last=bool(pos["drop_last"]),
    )
    note = (
        f"data position carried: epoch {pos['epoch']}, {start} of {pos['len']} samples consumed, "
        f"rest dealt to {live} ranks"
    )
    dealing = {
        **{k: pos[k] for k in ("len", "seed", "shuffle", "epoch")},
        "drop_last": ds.drop_last,
        "prefix": start,
        "world": live,
        "rank": ds.rank,
    }
    return {"indices": indices, "dealing": dealing, "base": 0, "dealt": len(indices)}, note


def _reshardable(loader: DataLoader[Any], pos: dict[str, Any] | None, saved: int, live: int) -> Any:
    """The live DistributedSampler, or StateMismatchError naming why the data position
    recorded at ``saved`` ranks cannot be carried to ``live`` ranks."""
    why = _why_not_reshardable(loader)
    if why is None and pos is None:
        why = "the checkpoint records no data position (it predates elastic resume)"
    sampler = loader.sampler
    if why is None and pos is not None and len(sampler.dataset) != pos["len"]:  # type: ignore[attr-defined]
        why = f"the dataset has {len(sampler.dataset)} samples, the checkpoint's had {pos['len']}"  # type: ignore[attr-defined]
    if why is not None:
        raise StateMismatchError(
            f"cannot carry the DataLoader's position from {saved} to {live} rank(s): {why}"
        )
    return sampler


def loader_batch_size(loader: DataLoader[Any]) -> int:
    return int(loader.batch_size) if loader.batch_size is not None else 1


def _why_not_reshardable(loader: DataLoader[Any]) -> str | None:
    if loader.batch_size is None and loader.batch_sampler is not None:
        return "the DataLoader was given its own batch_sampler"
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        return f"its sampler is a {type(sampler).__name__}, not a torch.utils.data.DistributedSampler"
    if type(sampler).__iter__ is not DistributedSampler.__iter__:
        return f"its sampler {type(sampler).__name__} overrides DistributedSampler's order"
    return None


def fresh_dealing(loader: DataLoader[Any]) -> dict[str, Any] | None:
    """The dealing a live DistributedSampler is about to iterate (the whole epoch), or None."""
    if _why_not_reshardable(loader) is not None:
        return None
    s: Any = loader.sampler
    return {
        "len": len(s.dataset),
        "seed": int(s.seed),
        "shuffle": bool(s.shuffle),
        "epoch": int(s.epoch),
        "drop_last": bool(s.drop_last),
        "prefix": 0,
        "world": int(s.num_replicas),
        "rank": int(s.rank),
    }


def live_world(loader: DataLoader[Any]) -> int:
    """The world size this loader's data is dealt to: its DistributedSampler's ``num_replicas``,
    else torch.distributed's world size, else 1."""
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(s, DistributedSampler):
            return int(s.num_replicas)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1
