"""``smartckpt_cli.carry``: the values a loop carries from one iteration into the next, kept with
each zero-code checkpoint and handed back after a restore.

A checkpoint holds the model, optimizer, schedulers, RNG and data position. What a loop holds in
its own variables across the step boundary is not there: a batch fetched before the optimizer
step (nanoGPT's prefetch), an RNN's hidden state, the best validation loss so far, EMA weights.
Without them a resume is not exact (the resume check says so). The loop names them once per
iteration, at the top of its body::

    X, Y, best = smartckpt_cli.carry(X=X, Y=Y, best=best)

Order of calls: ``start_step()`` restores the checkpoint of step N; the first ``carry()`` after it
(the top of iteration N+1) returns what the interrupted run passed at the top of its iteration
N+1, i.e. what it carried out of iteration N; every other call returns its arguments unchanged
and keeps them for the checkpoint the next optimizer step may take (zero-code mode saves step N
in the pre-hook of step N+1, after that call). Tensors are restored onto the device of the value
passed; an object with ``state_dict``/``load_state_dict`` (an EMA model) is saved through them
and loaded in place. A final checkpoint (the loop has ended) carries none: the last call came
before the last step. Outside ``smartckpt run``, and with a script's own CheckpointManager
(register an object with ``state_dict``/``load_state_dict`` there), it returns its arguments.

No torch at import: ``import smartckpt_cli`` stays lazy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from smartckpt_cli.engine.heartbeat import run_dir

__all__ = ["CARRIED", "Carried", "carried", "carry"]

logger = logging.getLogger(__name__)

CARRIED = "carried"  # the name the values are registered under


def _has_state(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _copy(v: Any) -> Any:
    """Tensors (in tuples, lists, dicts) copied: the loop may change them in place before the
    save that reads them."""
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, tuple | list):
        return type(v)(_copy(x) for x in v)
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return v


def _like(saved: Any, now: Any) -> Any:
    """A restored value on the device of the value the loop passed (same nesting)."""
    import torch

    if isinstance(saved, torch.Tensor) and isinstance(now, torch.Tensor):
        return saved.to(now.device)
    if isinstance(saved, tuple | list) and isinstance(now, tuple | list) and len(saved) == len(now):
        return type(saved)(_like(s, n) for s, n in zip(saved, now, strict=True))
    if isinstance(saved, dict) and isinstance(now, dict):
        return {k: _like(v, now.get(k)) for k, v in saved.items()}
    return saved


class Carried:
    """The carried values as a registered object of the checkpoint (kind ``state``)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.objects: dict[str, Any] = {}
        self.restored: dict[str, Any] | None = None  # to hand out at the next carry()
        self.restored_step = 0
        self.stale = False  # the loop ended: the last values came before the last step
        self.used = False
        self.copy_now: Callable[[], bool] = lambda: False  # zero-code: True when a save may read them
        self.on_first_use: Callable[[], None] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.stale:
            return {"stale": True}
        return {
            "values": dict(self.values),
            "objects": {k: o.state_dict() for k, o in self.objects.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state

    def carry(self, values: dict[str, Any]) -> dict[str, Any]:
        if not self.used:
            self.used = True
            if self.on_first_use is not None:
                self.on_first_use()
        out = dict(values)
        restored, self.restored = self.restored, None
        if restored is not None:
            out = self._hand_back(restored, values)
        copy = self.copy_now()
        self.values = {k: (_copy(v) if copy else v) for k, v in out.items() if not _has_state(v)}
        self.objects = {k: v for k, v in out.items() if _has_state(v)}
        self.stale = False
        return out

    def _hand_back(self, restored: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        if restored.get("stale") or "values" not in restored:
            logger.warning(
                "smartckpt: carry(): the checkpoint of step %d holds no carried values (it is the "
                "final one of a finished run): starting them afresh",
                self.restored_step,
            )
            return dict(values)
        saved, objects = restored.get("values") or {}, restored.get("objects") or {}
        out = dict(values)
        missing = []
        for k, now in values.items():
            if k in objects and _has_state(now):
                now.load_state_dict(objects[k])
            elif k in saved:
                out[k] = _like(saved[k], now)
            else:
                missing.append(k)
        if missing:
            logger.warning(
                "smartckpt: carry(): %s not in the checkpoint of step %d: started afresh",
                ", ".join(missing),
                self.restored_step,
            )
        return out


carried = Carried()  # one per process: zero-code mode registers it with its manager


def carry(**values: Any) -> Any:
    """Name what the loop carries into this iteration; call it at the top of the loop body.
    Returns the values (one value alone, several as a tuple in the order given): those restored
    from the checkpoint at the first call after ``start_step()`` restored one, the arguments
    unchanged otherwise. See the module docstring and the README, section "Your loop"."""
    if not values:
        raise TypeError("carry() takes the carried values by name: carry(hidden=hidden)")
    if run_dir() is None:  # not under smartckpt run: nothing checkpoints them
        got = list(values.values())
        return got[0] if len(got) == 1 else tuple(got)
    out = carried.carry(values)
    got = [out[k] for k in values]
    return got[0] if len(got) == 1 else tuple(got)
