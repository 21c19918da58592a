"""Zero-code mode: checkpoint a plain training loop from the global optimizer hooks that
:mod:`smartckpt_cli.agent.runtime` installs (see there for when it arms and stands down).

:func:`discover` finds the optimizers (``gc``), the top-level modules owning their parameters, the
LR schedulers attached to them, an enabled GradScaler and (from ``start_step`` only, before their
first epoch) the DataLoaders; :class:`ZeroCode` registers them with a CheckpointManager.

Names must be the same in every run of a script, or a restart loads one object's state into
another (a train and a val loader, two optimizers of one shape). ``gc`` lists objects in no stable
order, so it only *finds* them, and :mod:`.naming` names them: they are ordered by when they
were created (``stamp_creation`` numbers every optimizer, scheduler, GradScaler and DataLoader as
it is built, once the hooks are installed at ``import torch``), and named by the script's own
variables where those are found (the frames of the loop and ``__main__``'s globals: ``opt_g``,
``val_loader``), else by kind and creation order. One object of a kind keeps the kind's name
(``optimizer``, ``data``). A loader's dataset length and sampler are saved with its position: a
different one is refused on restore.

Exactness. The usual loop is ``backward(); opt.step(); sched.step(); opt.zero_grad()``. The
checkpoint of step N must hold what the loop holds at the end of iteration N:

* parameters and optimizer moments after ``opt.step`` N: unchanged until ``opt.step`` N+1;
* optimizer hyperparameters, scheduler and GradScaler after the code that follows ``opt.step``
  N (``sched.step``, ``scaler.update``): only final once that code has run;
* RNG, data position and buffers that forward mutates (BatchNorm statistics) as after iteration
  N: the forward/backward of N+1 changes them *before* ``opt.step`` N+1.

So the optimizer **post-hook** of step N records the RNG state, the DataLoader positions and the
buffers forward mutates (normalisation layers' from the start, others learned from their version
counters, see :class:`_BoundaryModule`; a step at which one is first seen cannot be saved), and
the **pre-hook** of step N+1 feeds the trigger with step N and loss N and, when it fires,
snapshots the live parameters, optimizer and schedulers together with those records.

Recording is most of what a step costs here (three RNG states, buffer copies), and most steps
cannot save: the post-hook records only where the manager says a save of step N is possible
(:meth:`CheckpointManager.may_save`: an evaluation near, a signal or save pending, the policy's
quiet period ending). Elsewhere the pre-hook calls ``step(..., can_save=False)``, and a save the
trigger asks for there after all (time passed in between) is taken at the next step, recorded. The manager's lazy copy guard runs in the same
``opt.step`` call, right after. At a clean exit the same is done once more (a final checkpoint),
so a finished run started again resumes at its last step and ends at once. Several optimizers
stepping in one iteration work the same way: the first one that steps marks the iteration.

A GradScaler that skips ``opt.step`` after an overflow still counts the step (its ``step`` is
wrapped on the instance), and the loss fed to the trigger is divided by its scale.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smartckpt_cli.agent.carry import CARRIED, carried
from smartckpt_cli.agent.naming import _created, _names, script_names
from smartckpt_cli.engine.heartbeat import beat, beat_step, heartbeat_state
from smartckpt_cli.state import wrappers
from smartckpt_cli.state.wrappers import ACCELERATOR

__all__ = ["ZeroCode", "discover"]

logger = logging.getLogger(__name__)


@dataclass
class _Found:
    """What zero-code mode checkpoints, in a stable order (names must match across restarts)."""

    optimizers: list[Any] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # id -> the script's variable name, where found
    accelerator: Any = None  # accelerate's, when it prepared what is found (state/wrappers.py)


def discover(*, with_loaders: bool) -> _Found:
    """Find the training objects among the live ones. Optimizers are ordered by their parameters'
    shapes (stable across runs of one script), modules by where their parameters appear in the
    optimizers, schedulers by their optimizer; only top-level modules are kept."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.utils.data import DataLoader

    scaler_types = tuple(
        t for t in (getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)) if t
    )
    opts, mods, scheds, scalers, loaders, prepared, accs = [], [], [], [], [], [], []
    for o in gc.get_objects():
        t = type(o)  # not isinstance: that reads __class__, which some objects warn about
        if issubclass(t, torch.optim.Optimizer):
            if wrappers.inner(o) is o:  # a wrapper's optimizer is found itself
                opts.append(o)
        elif issubclass(t, torch.nn.Module):
            mods.append(o)
        elif issubclass(t, LRScheduler | ReduceLROnPlateau):
            scheds.append(o)
        elif scaler_types and issubclass(t, scaler_types):
            scalers.append(o)
        elif with_loaders and issubclass(t, DataLoader):
            loaders.append(o)
        elif with_loaders and wrappers.is_prepared_loader(o):
            prepared.append(o)  # accelerate's: it iterates the DataLoader inside it
        elif wrappers.is_accelerator(o):
            accs.append(o)
    inside = {id(p.base_dataloader) for p in prepared}
    loaders = [ld for ld in loaders if id(ld) not in inside] + prepared
    opts.sort(
        key=lambda o: (
            _created(o),
            type(o).__name__,
            [tuple(p.shape) for g in o.param_groups for p in g["params"]],
        )
    )
    where: dict[int, tuple[int, int]] = {}
    for i, o in enumerate(opts):
        for j, p in enumerate(p for g in o.param_groups for p in g["params"]):
            where.setdefault(id(p), (i, j))
    owners = [m for m in mods if any(id(p) in where for p in m.parameters())]
    inner = {id(c) for m in owners for c in m.modules() if c is not m}
    top = [m for m in owners if id(m) not in inner]
    top.sort(key=lambda m: min(where[id(p)] for p in m.parameters() if id(p) in where))
    opt_index = {id(o): i for i, o in enumerate(opts)}
    children = {id(c) for s in scheds for c in getattr(s, "_schedulers", [])}
    scheds = [s for s in scheds if id(getattr(s, "optimizer", None)) in opt_index and id(s) not in children]
    scheds.sort(key=lambda s: opt_index[id(s.optimizer)])
    scalers = sorted((s for s in scalers if s.is_enabled()), key=_created)
    loaders.sort(key=_created)
    names = script_names([*opts, *top, *scheds, *scalers, *loaders])
    return _Found(opts, top, scheds, scalers, loaders, names, accs[0] if len(accs) == 1 else None)


@dataclass(slots=True)
class _Record:
    """The state of iteration N that iteration N+1's forward/backward changes (post-hook N)."""

    step: int
    loss: torch.Tensor | None
    states: dict[str, Any] | None  # "rng" and each DataLoader's name -> state_dict; None: not recorded
    scale: torch.Tensor | None = None  # the GradScaler's scale the loss was multiplied by


class _Recorded:
    """A registered object whose ``state_dict`` is the one recorded at the last post-hook."""

    def __init__(self, live: Any, name: str, zc: ZeroCode) -> None:
        self.live, self.name, self.zc = live, name, zc

    def state_dict(self) -> Any:
        rec = self.zc.saving
        # Unrecorded: the live state, only ever read to size the staging (no save is taken).
        return rec.states[self.name] if rec is not None and rec.states is not None else self.live.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.live.load_state_dict(state)


class _BoundaryModule:
    """A top-level module whose buffers that forward mutates are taken as at the last post-hook.

    Which buffers forward mutates is learned per submodule: when the version counter of any of a
    submodule's buffers moves between a post-hook and the next pre-hook, all of that submodule's
    buffers are copied at every post-hook from then on. BatchNorm's kernel updates its running
    statistics without bumping their version (only ``num_batches_tracked`` moves), hence the
    grouping, and normalisation layers are copied from the start."""

    def __init__(self, module: torch.nn.Module) -> None:
        from torch.nn.modules.batchnorm import _NormBase

        self.module = module
        self.buffers: dict[str, torch.Tensor] = {}
        self.groups: list[list[str]] = []
        self.copies: dict[str, torch.Tensor] = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            keys = []
            for name, buf in sub._buffers.items():
                if buf is not None and name not in sub._non_persistent_buffers_set:
                    key = f"{prefix}.{name}" if prefix else name
                    self.buffers[key] = buf
                    keys.append(key)
            if keys:
                self.groups.append(keys)
                if isinstance(sub, _NormBase):
                    self._copy(keys)
        self.versions: dict[str, int] = {}

    def _copy(self, keys: list[str]) -> bool:
        new = [k for k in keys if k not in self.copies]
        for k in new:
            self.copies[k] = torch.empty_like(self.buffers[k])
        return bool(new)

    def record(self) -> None:
        for k, c in self.copies.items():
            c.copy_(self.buffers[k].detach())
        self.versions = {k: t._version for k, t in self.buffers.items()}

    def check(self) -> bool:
        """Pre-hook: False when a buffer not copied so far changed since the post-hook."""
        exact = True
        for keys in self.groups:
            if any(self.buffers[k]._version != self.versions.get(k) for k in keys) and self._copy(keys):
                exact = False
        return exact

    def state_dict(self) -> dict[str, Any]:
        sd = self.module.state_dict()
        sd.update(self.copies)
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)


class ZeroCode:
    """Zero-code checkpointing of what :func:`discover` found, through ``mgr``. The runtime calls
    ``before_step``/``after_step`` from the global optimizer hooks, ``restore`` from
    ``start_step`` and ``finish`` at exit; ``loss()`` returns the step's loss (the scalars
    ``backward`` ran on since the last step, summed) and ``loss_done()`` starts the next one."""

    def __init__(
        self,
        found: _Found,
        mgr: Any,
        *,
        loss: Callable[[], torch.Tensor | None],
        on_error: Callable[[str, BaseException], None],
        loss_done: Callable[[], None] = lambda: None,
    ) -> None:
        from smartckpt_cli.state.registry import MODULE, RNG, adapt
        from smartckpt_cli.state.rng import RNGState

        self.mgr = mgr
        self.loss = loss
        self.loss_done = loss_done  # the step ended: the next backward() starts the next loss
        self.on_error = on_error
        self.active = True
        self.optimizers = found.optimizers
        self.primary: Any = None
        self.step = 0
        self.pending: _Record | None = None
        self.saving: _Record | None = None  # the record a snapshot reads, while it is taken
        self.started = False
        self.modules = [_BoundaryModule(m) for m in found.modules]
        self.live: dict[str, Any] = {RNG: RNGState()}
        # The wrapped objects are registered with the kind of what they wrap (module checks and
        # tiers on restore), which plain ``register`` would not see in a wrapper.
        mgr.register_as(RNG, _Recorded(self.live[RNG], RNG, self), kind=RNG)
        known = found.names
        for name, w in zip(_names("model", found.modules, known), self.modules, strict=True):
            mgr.register_as(name, w, kind=MODULE)
        mgr.register(**dict(zip(_names("optimizer", found.optimizers, known), found.optimizers, strict=True)))
        mgr.register(**dict(zip(_names("scheduler", found.schedulers, known), found.schedulers, strict=True)))
        mgr.register(**dict(zip(_names("scaler", found.scalers, known), found.scalers, strict=True)))
        recorded = list(zip(_names("data", found.loaders, known), found.loaders, strict=True))
        if found.accelerator is not None:  # its counter moves with the data: taken with it
            recorded.append((ACCELERATOR, found.accelerator))
        for name, obj in recorded:
            kind, state = adapt(obj)
            self.live[name] = state
            mgr.register_as(name, _Recorded(state, name, self), kind=kind)
        self.ids = {id(o) for o in self.optimizers}
        self.posts: dict[int, int] = {}  # post-hooks seen, per optimizer
        self.scalers = found.scalers
        for scaler in self.scalers:
            self._count_skipped_steps(scaler)
        # The loop's own carried values (carry.py): registered once the loop names them.
        carried.copy_now = self._may_save_carried
        carried.on_first_use = self._register_carried
        if carried.used:
            self._register_carried()
        logger.info(
            "zero-code checkpointing: %s", ", ".join(n for n in mgr.names() if n != RNG) or "nothing found"
        )

    def _register_carried(self) -> None:
        from smartckpt_cli.state.registry import STATE

        if self.active and CARRIED not in self.mgr.names():
            self.mgr.register_as(CARRIED, carried, kind=STATE)

    def _may_save_carried(self) -> bool:
        """carry() at the top of iteration N+1: whether the checkpoint of step N may be taken (its
        boundary was recorded), so the values must be copied as they are now."""
        return self.pending is not None and self.pending.states is not None

    def restore(self) -> int:
        if self.started or self.step:
            logger.warning("start_step() called after training started: nothing restored")
            return self.step
        self.started = True
        with heartbeat_state("RESTORING"):
            loaded = self.mgr.read()
            self.step = self.mgr.apply(loaded) if loaded is not None else 0
        if loaded is not None and CARRIED in loaded.manifest.get("objects", {}):
            # kept for the loop's first carry(), which comes after this (carry.py)
            from smartckpt_cli.state.apply import apply_checkpoint
            from smartckpt_cli.state.registry import STATE

            apply_checkpoint(loaded, {CARRIED: (STATE, carried)})
            carried.restored_step = self.step
        beat(self.step, state=None)
        return self.step

    def _count_skipped_steps(self, scaler: Any) -> None:
        """A GradScaler skips ``optimizer.step`` (no hooks run) when the gradients overflowed, but the
        loop still went through a step: count it, or the loop index and the checkpoint step drift
        apart. (Wraps this instance's ``step`` only.)"""
        original = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = self.posts.get(id(optimizer), 0)
            out = original(optimizer, *args, **kwargs)
            if self.active and id(optimizer) in self.ids and self.posts.get(id(optimizer), 0) == before:
                try:
                    self.before_step(optimizer)
                    self.after_step(optimizer)
                    self.loss_done()  # no optimizer post-hook ran to start the next step's loss
                except Exception as err:
                    self.on_error("GradScaler step", err)
            return out

        scaler.step = step

    def after_step(self, optimizer: Any) -> None:
        if id(optimizer) not in self.ids:
            return
        self.started = True
        self.mgr.update_done()  # the loss update_begins handed over goes with no later save
        if self.scalers:  # counted only for the GradScaler's skipped steps (_count_skipped_steps)
            self.posts[id(optimizer)] = self.posts.get(id(optimizer), 0) + 1
        if optimizer is self.primary:
            self.step += 1
            beat_step(self.step)
        states = None
        if self.mgr.may_save(self.step):
            states = self.record()
        scale = getattr(self.scalers[0], "_scale", None) if self.scalers else None
        # the scaled loss was backpropagated: the manager divides the scale out where it keeps it
        self.pending = _Record(
            self.step, self.loss(), states, scale if isinstance(scale, torch.Tensor) else None
        )

    def record(self) -> dict[str, Any]:
        """The boundary states a save reads (RNG, data positions; the buffers forward mutates)."""
        states = {name: obj.state_dict() for name, obj in self.live.items()}
        for m in self.modules:
            m.record()
        return states

    def before_step(self, optimizer: Any) -> None:
        if id(optimizer) not in self.ids:
            return
        if self.primary is None:
            self.primary = optimizer
        if optimizer is not self.primary:
            return
        # This step's loss exists already (its backward ran): the resume check takes it here, for
        # the checkpoint of the previous step saved below, or after a restore (resumecheck.py).
        # Only where either may happen: elsewhere this costs a comparison.
        pending = self.pending
        if (pending is None or pending.states is None) and not self.mgr.wants_loss_before_update(
            self.step + 1
        ):
            self._step_boundary()
            return
        scale = getattr(self.scalers[0], "_scale", None) if self.scalers else None
        scale = scale if isinstance(scale, torch.Tensor) else None
        # Kept until this step's post-hook: the manager's own pre-hook, which runs next, may take
        # a precursor save of the previous step too.
        self.mgr.update_begins(self.step + 1, self.loss(), scale, optimizer)
        self._step_boundary()

    def _step_boundary(self) -> None:
        if self.pending is None:
            return
        rec, self.pending = self.pending, None
        # A buffer forward mutates that was just discovered makes this step unsaveable; from the
        # next recorded step on it is copied too.
        recorded = rec.states is not None and all([m.check() for m in self.modules])
        self.saving = rec
        try:
            self.mgr.step(rec.step, loss=rec.loss, loss_scale=rec.scale, can_save=recorded)
        finally:
            self.saving = None

    def finish(self, *, final_save: bool) -> None:
        """At interpreter exit: a final checkpoint (after a clean run), then close the manager."""
        self.active = False
        carried.stale = True  # the loop's last carry() came before its last step
        rec, self.pending = self.pending, None
        if rec is not None and rec.states is None:
            # The last step was not recorded (no save was due): its boundary is as at exit.
            rec.states = self.record()
        try:
            if final_save and rec is not None and all([m.check() for m in self.modules]):
                self.saving = rec
                try:
                    with heartbeat_state("SAVING"):
                        self.mgr.save(rec.step, reason="final", blocking=True)
                finally:
                    self.saving = None
        finally:
            with heartbeat_state("SAVING"):
                self.mgr.close()
