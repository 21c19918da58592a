"""Wrappers seen through: what frameworks hand a training loop in place of the torch objects.

``accelerate``'s ``Accelerator.prepare`` returns an ``AcceleratedOptimizer`` and an
``AcceleratedScheduler`` (they hold the real optimizer and scheduler and keep nothing of their own
a resume needs), and prepared DataLoaders (``DataLoaderShard``) that iterate a plain DataLoader
one batch ahead of what they hand out and keep an epoch counter of their own (``iteration``),
handed to the sampler at every epoch start. The ``Accelerator`` keeps the gradient-accumulation
step counter (``step``). :func:`inner` gives what a wrapper wraps (the manager registers that,
zero-code mode finds that), :func:`prepared_loader_state` the state of a prepared DataLoader, and
:func:`accelerator_state` the counter. Matched by their classes' names and modules: nothing here
imports accelerate.

``DistributedDataParallel`` and PEFT's ``PeftModel`` are modules: registered as they are (a DDP's
``state_dict`` is its module's, prefixed; engine/ddp_layout.py finds the DDP of a module
registered without it).
"""

from __future__ import annotations

import gc
from typing import Any

from smartckpt_cli.state.data import LoaderState

__all__ = [
    "ACCELERATOR",
    "PreparedLoader",
    "accelerator_of",
    "accelerator_state",
    "inner",
    "is_accelerator",
    "is_prepared_loader",
]

ACCELERATOR = "accelerator"  # the name its step counter is registered under

# (module prefix, class name) -> the attribute that holds the wrapped object
_PURE: dict[tuple[str, str], str] = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("accelerate.scheduler", "AcceleratedScheduler"): "scheduler",
}


def _is(obj: Any, module: str, name: str) -> bool:
    t = type(obj)  # not isinstance: accelerate's DataLoaderAdapter lies about __class__
    return any(c.__name__ == name and c.__module__.startswith(module) for c in t.__mro__)


def inner(obj: Any) -> Any:
    """What a pure wrapper wraps (through several), else ``obj`` itself."""
    for _ in range(8):
        attr = next((a for (m, n), a in _PURE.items() if _is(obj, m, n)), None)
        if attr is None or getattr(obj, attr, None) is None:
            return obj
        obj = getattr(obj, attr)
    return obj


def is_prepared_loader(obj: Any) -> bool:
    """accelerate's prepared DataLoader over a plain one (a stateful one has a state_dict of its
    own, used as it is)."""
    return (
        _is(obj, "accelerate.data_loader", "DataLoaderShard")
        and hasattr(obj, "base_dataloader")
        and not getattr(obj, "use_stateful_dataloader", False)
    )


class PreparedLoader:
    """``state_dict``/``load_state_dict`` of a ``DataLoaderShard``: its epoch counter and its
    inner DataLoader's position (state/data.py), which it fetches one batch ahead."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.base = LoaderState.of(loader.base_dataloader)
        self.base.lookahead = 1

    def state_dict(self) -> dict[str, Any]:
        state = self.base.state_dict()
        # At the end of an epoch the shard counts it only once its last batch's step is done:
        # a resume that begins the next epoch (state["next"]) begins the next counter too.
        state["iteration"] = int(self.loader.iteration) + (1 if state.get("next") else 0)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict({k: v for k, v in state.items() if k != "iteration"})
        if "iteration" in state:
            self.loader.iteration = int(state["iteration"])

    # what LoaderState offers the manager (registered(name).epochs / .batches)
    @property
    def epochs(self) -> int:
        return self.base.epochs

    @property
    def batches(self) -> int:
        return self.base.batches


def prepared_loader_state(loader: Any) -> PreparedLoader:
    tracker = getattr(loader, "_smartckpt_prepared", None)
    if not isinstance(tracker, PreparedLoader):
        tracker = PreparedLoader(loader)
        loader._smartckpt_prepared = tracker
    return tracker


def is_accelerator(obj: Any) -> bool:
    return _is(obj, "accelerate.accelerator", "Accelerator")


class _AcceleratorCounter:
    """The Accelerator's gradient-accumulation step counter."""

    def __init__(self, acc: Any) -> None:
        self.acc = acc

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.acc.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.acc.step = int(state.get("step", 0))


def accelerator_state(acc: Any) -> _AcceleratorCounter:
    return _AcceleratorCounter(acc)


def accelerator_of(objs: list[Any]) -> Any:
    """The one live Accelerator when any of ``objs`` is something it prepared; None otherwise
    (or when there are several: which one counts is not known)."""
    if not any(inner(o) is not o or is_prepared_loader(o) for o in objs):
        return None
    found = [o for o in gc.get_objects() if is_accelerator(o)]
    return found[0] if len(found) == 1 else None
