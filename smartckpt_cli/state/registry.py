"""What kind of state an object is, decided once per type (one registry, no isinstance chains
scattered around). The kind selects the default tiers and the checks made on restore."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DATA", "KINDS", "MODULE", "OPTIMIZER", "RNG", "STATE", "adapt", "register_kind"]

# The kinds of state (what a manifest entry's ``kind`` says): the names to use, not string literals.
MODULE, OPTIMIZER, DATA, STATE, RNG = "module", "optimizer", "data", "state", "rng"
KINDS = (MODULE, OPTIMIZER, DATA, STATE, RNG)

# (predicate, kind, wrap): the first predicate that matches wins.
_KINDS: list[tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = []


def register_kind(
    predicate: Callable[[Any], bool], kind: str, wrap: Callable[[Any], Any] = lambda o: o
) -> None:
    _KINDS.append((predicate, kind, wrap))


def _plain_dataloader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader) and not hasattr(obj, "state_dict")


def _loader_state(obj: Any) -> Any:
    from smartckpt_cli.state.data import LoaderState

    return LoaderState.of(obj)


register_kind(lambda o: isinstance(o, torch.nn.Module), MODULE)
register_kind(lambda o: isinstance(o, torch.optim.Optimizer), OPTIMIZER)
register_kind(_plain_dataloader, DATA, _loader_state)
register_kind(lambda o: hasattr(o, "state_dict") and hasattr(o, "load_state_dict"), STATE)


def adapt(obj: Any) -> tuple[str, Any]:
    """Returns (kind, object with state_dict/load_state_dict). Wrappers are seen through
    (state/wrappers.py): an ``AcceleratedOptimizer`` is its optimizer, a prepared DataLoader its
    position and epoch counter, an ``Accelerator`` its step counter."""
    from smartckpt_cli.state import wrappers

    inner = wrappers.inner(obj)
    if inner is not obj:
        return adapt(inner)
    if wrappers.is_prepared_loader(obj):
        return DATA, wrappers.prepared_loader_state(obj)
    if wrappers.is_accelerator(obj):
        return STATE, wrappers.accelerator_state(obj)
    for predicate, kind, wrap in _KINDS:
        if predicate(obj):
            return kind, wrap(obj)
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: it has no state_dict/load_state_dict")
