"""The state at the last step boundary, for a save taken before the optimizer update.

The trigger's precursor alarm is decided in the optimizer's step pre-hook (trigger.py,
``before_update``), where the planned update and the gradients are measured. A save there must
be the checkpoint of the *previous* step. Parameters and optimizer state are still as they were
at that boundary (the update has not run; LR schedulers and GradScalers step after it), but
four things may have moved since: the DataLoader yielded this step's batch, forward drew from
the random generators, the loop may have set this step's hyperparameters in the optimizer's
param groups (a learning rate set at the top of each step), and forward may have changed
buffers (BatchNorm's running statistics).

:class:`Boundary` captures the first three at the boundary — a few kilobytes, and only when the
next step evaluates the signals — and notes the version counters of the registered modules'
buffers and of every registered optimizer's parameters. At the pre-hook, :meth:`Boundary.objects`
answers the registered objects with the captured states in place of the live ones, or None when
a buffer moved or a parameter did: with several optimizers the save is decided in the last one's
pre-hook, and when an earlier one has already stepped (an encoder and a head each with its Adam,
a GAN's two) its parameters and moments are no longer those of the boundary. The pre-update save
is then not taken (:attr:`Boundary.why_not` says why, logged once) and the alarm waits for the
step boundary. Other registered objects are read as they are at the pre-hook: one that changes
during forward is not covered.

In zero-code mode the manager's step boundary is itself called from the next step's pre-hook
(zerocode.py records the RNG, data and buffers at the post-hook before it), so there, as for its
regular saves, param-group settings the loop writes at the top of a step are taken as written.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Boundary"]

_CAPTURED = ("rng", "data")  # kinds that forward/the loader change before the update


def _hyper(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's settings (all but its parameters), copied."""
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


class _Frozen:
    """A registered object whose ``state_dict`` is the one captured at the boundary."""

    def __init__(self, state: Any, live: Any) -> None:
        self.state, self.live = state, live

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.live.load_state_dict(state)


class _BoundaryOptimizer:
    """An optimizer whose ``state_dict`` has the param-group settings of the boundary (its
    moments have not moved: the update has not run)."""

    def __init__(self, live: Any, groups: list[dict[str, Any]]) -> None:
        self.live, self.groups = live, groups

    @property
    def param_groups(self) -> Any:  # the parameters themselves are the live ones
        return self.live.param_groups

    def state_dict(self) -> Any:
        sd = self.live.state_dict()
        sd["param_groups"] = [{**g, **h} for g, h in zip(sd["param_groups"], self.groups, strict=True)]
        return sd

    def load_state_dict(self, state: Any) -> None:
        self.live.load_state_dict(state)


class Boundary:
    def __init__(self) -> None:
        self.step: int | None = None
        self._states: dict[str, Any] = {}
        self._groups: dict[str, list[dict[str, Any]]] = {}
        self._versions: list[tuple[torch.Tensor, int]] = []
        self._params: list[tuple[str, torch.Tensor, int]] = []  # (optimizer name, parameter, version)
        self.why_not: str | None = None  # why the last objects() answered None

    def capture(self, step: int, objects: dict[str, tuple[str, Any]]) -> None:
        """At the boundary after ``step``: the states a pre-update save of ``step`` needs."""
        self.step = step
        self._states = {name: obj.state_dict() for name, (kind, obj) in objects.items() if kind in _CAPTURED}
        self._groups = {name: _hyper(obj) for name, (kind, obj) in objects.items() if kind == "optimizer"}
        self._versions = [
            (b, b._version)
            for kind, obj in objects.values()
            if kind == "module" and isinstance(obj, torch.nn.Module)
            for b in obj.buffers()
        ]
        self._params = [
            (name, p, p._version)
            for name, (kind, obj) in objects.items()
            if kind == "optimizer"
            for g in obj.param_groups
            for p in g["params"]
            if isinstance(p, torch.Tensor)
        ]

    def clear(self) -> None:
        self.step = None
        self._states, self._groups, self._versions, self._params = {}, {}, [], []

    def objects(self, objects: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]] | None:
        """``objects`` as at the boundary, or None when nothing was captured, a buffer moved, an
        optimizer already stepped (several optimizers) or its param groups were added since;
        :attr:`why_not` then says which."""
        self.why_not = None
        if self.step is None:
            self.why_not = "no boundary was captured"
            return None
        if any(b._version != v for b, v in self._versions):
            self.why_not = "a buffer changed during forward (BatchNorm statistics, ...)"
            return None
        moved = next((name for name, p, v in self._params if p._version != v), None)
        if moved is not None:
            self.why_not = (
                f"optimizer {moved!r} already stepped in this iteration (several optimizers step one "
                "after another; the save before the update is decided after the last one's gradients)"
            )
            return None
        out: dict[str, tuple[str, Any]] = {}
        for name, (kind, obj) in objects.items():
            if name in self._states:
                obj = _Frozen(self._states[name], obj)
            elif name in self._groups:
                if len(self._groups[name]) != len(obj.param_groups):
                    self.why_not = f"optimizer {name!r} gained a param group"
                    return None
                obj = _BoundaryOptimizer(obj, self._groups[name])
            out[name] = (kind, obj)
        return out
