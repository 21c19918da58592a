"""Stable names for what zero-code mode checkpoints: the same object gets the same name in every
run of a script, or a restart loads one object's state into another (a train and a val loader,
two optimizers of one shape).

``gc`` lists objects in no stable order, so :func:`~smartckpt_cli.agent.zerocode.discover` orders
them by when they were created (:func:`stamp_creation` numbers every optimizer, scheduler,
GradScaler and DataLoader as it is built) and names them by the script's own variables where
those are found (:func:`script_names`), else by kind and creation order (``_names``). Apart
from :mod:`.zerocode`, which finds, registers and records the objects: the stamps are put on the
classes at ``import torch`` (:mod:`.runtime`), long before zero-code mode arms, and naming reads
only them and the script's frames.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["script_names", "stamp_creation"]

_creation = itertools.count()
_UNSTAMPED = 1 << 62  # created before the hooks were installed: after every stamped one
# Kept beside the objects, never in them: an LR scheduler's state_dict() is its __dict__.
_stamps: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _created(obj: Any) -> int:
    try:
        return _stamps.get(obj, _UNSTAMPED)
    except TypeError:  # not weakly referenceable or not hashable: never stamped
        return _UNSTAMPED


def stamp_creation() -> None:
    """Number every optimizer, LR scheduler, GradScaler and DataLoader as it is created (called
    once, when the hooks are installed at ``import torch``): a creation order that is the same in
    every run of a script, unlike ``gc``'s."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.utils.data import DataLoader

    classes: list[type] = [torch.optim.Optimizer, LRScheduler, ReduceLROnPlateau, DataLoader]
    classes += [t for t in (getattr(torch.amp, "GradScaler", None),) if isinstance(t, type)]
    for cls in classes:
        init = getattr(cls, "__init__")  # noqa: B009 (mypy refuses cls.__init__ on a type variable)
        if not getattr(init, "_smartckpt_stamp", False):
            setattr(cls, "__init__", _stamping(init))  # noqa: B010


def _stamping(init: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        with contextlib.suppress(TypeError):
            if self not in _stamps:  # once, whatever the subclass chain
                _stamps[self] = next(_creation)

    __init__._smartckpt_stamp = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    return __init__


_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_OURS = ("smartckpt_cli", "torch", "typing", "contextlib", "threading", "importlib")


def script_names(objs: list[Any]) -> dict[int, str]:
    """The script's own variable names of ``objs`` (by id): the locals of the frames that led here
    (innermost first: the loop that called ``start_step()`` or ``optimizer.step()``), then
    ``__main__``'s globals. A name found for two of them, or none, gives no name."""
    wanted = {id(o) for o in objs}
    found: dict[int, str] = {}
    seen_names: dict[str, int] = {}
    spaces: list[dict[str, Any]] = []
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_OURS):
            spaces.append(frame.f_locals)
        frame = frame.f_back  # type: ignore[assignment]
    main = sys.modules.get("__main__")
    if main is not None:
        spaces.append(vars(main))
    for space in spaces:
        for name, value in list(space.items()):
            if (
                id(value) in wanted
                and id(value) not in found
                and _IDENT.fullmatch(name)
                and not name.startswith("_")
            ):
                if seen_names.get(name, id(value)) != id(value):
                    continue
                found[id(value)] = name
                seen_names[name] = id(value)
    return found


def _names(base: str, objs: list[Any], known: dict[int, str] | None = None) -> list[str]:
    """One object: the kind's name. Several: the script's variable names when every one has its
    own, else the kind and the creation order (``optimizer0``, ``optimizer1``)."""
    if len(objs) == 1:
        return [base]
    names = [(known or {}).get(id(o)) for o in objs]
    if all(names) and len(set(names)) == len(names) and "rng" not in names:
        return [str(n) for n in names]
    return [f"{base}{i}" for i in range(len(objs))]
