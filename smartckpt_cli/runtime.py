"""What runs inside the training process when smartckpt is injected (``smartckpt run``).

``hooks/sitecustomize.py`` calls :func:`install_hooks` once ``torch`` has been imported, and only
when ``SMARTCKPT_RUN_DIR`` is set. That adds two global optimizer step hooks and a wrapper on
``backward`` that remembers the last scalar loss (detached, no host sync). Nothing more happens
until an optimizer steps (or the script calls :func:`start_step`): processes that never train stay
untouched. Then **zero-code mode** arms: it finds the optimizers (``gc``), the top-level modules
owning their parameters, the LR schedulers attached to them, an enabled GradScaler and (from
``start_step`` only, before their first epoch) the DataLoaders, and checkpoints them with a
:class:`~smartckpt_cli.manager.CheckpointManager` built from the settings (``SMARTCKPT_*``).

Exactness. The usual loop is ``backward(); opt.step(); sched.step(); opt.zero_grad()``. The
checkpoint of step N must hold what the loop holds at the end of iteration N:

* parameters and optimizer moments after ``opt.step`` N: unchanged until ``opt.step`` N+1;
* optimizer hyperparameters, scheduler and GradScaler after the code that follows ``opt.step``
  N (``sched.step``, ``scaler.update``): only final once that code has run;
* RNG, data position and buffers that forward mutates (BatchNorm statistics) as after iteration
  N: the forward/backward of N+1 changes them *before* ``opt.step`` N+1.

So the optimizer **post-hook** of step N records the RNG state, the DataLoader positions and the
buffers forward mutates (normalisation layers' from the start, others learned from their version
counters, see :class:`_BoundaryModule`; the step at which one is first seen is not offered to
the trigger), and the **pre-hook** of step N+1 feeds the
trigger with step N and loss N and, when it fires, snapshots the live parameters, optimizer and
schedulers together with those records. The manager's lazy copy guard runs in the same
``opt.step`` call, right after. At a clean exit the same is done once more (a final checkpoint),
so a finished run started again resumes at its last step and ends at once. Several optimizers
stepping in one iteration work the same way: the first one that steps marks the iteration.

:func:`start_step` restores the newest verified checkpoint into the discovered objects and returns
its step; outside ``smartckpt run`` it returns 0 (or restores through a manager set with
:func:`set_active_manager`). A script that creates its own ``CheckpointManager`` turns zero-code
mode off in that process (two managers cannot write one store); the heartbeat still beats from
``CheckpointManager.step``.

A GradScaler that skips ``opt.step`` after an overflow still counts the step (its ``step`` is
wrapped on the instance), and the loss fed to the trigger is divided by its scale.

Limits: one process per store (under ``WORLD_SIZE`` > 1 zero-code mode stands down and only the
heartbeat runs); modules must be on their device before ``start_step`` (buffers are tracked by
reference); a DataLoader iterated before ``start_step`` cannot be repositioned.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "active_manager",
    "beat",
    "heartbeat_state",
    "install_hooks",
    "manager_created",
    "set_active_manager",
    "start_step",
]

logger = logging.getLogger(__name__)

_active: Any = None


def set_active_manager(manager: Any) -> None:
    global _active
    _active = manager


def active_manager() -> Any:
    return _active


def _protocol() -> Any:
    from smartckpt_cli.hooks import _smartckpt_protocol

    return _smartckpt_protocol


def _run_dir() -> str | None:
    return os.environ.get("SMARTCKPT_RUN_DIR") or None


def _hooks_state() -> dict[str, Any]:
    """What sitecustomize shares with us (it sets ``uncaught`` when an exception ends the run)."""
    state = getattr(sys, "_smartckpt_hooks", None)
    return state if isinstance(state, dict) else {}


def _register_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit *before* concurrent.futures stops accepting work (its own
    exit hook is registered the same way, earlier, and these run last-registered first)."""
    reg = getattr(threading, "_register_atexit", None)
    try:
        if reg is not None:
            reg(fn)
            return
    except RuntimeError:
        return
    import atexit

    atexit.register(fn)


_reported = False


def _report(what: str, err: BaseException) -> None:
    global _reported
    if not _reported:
        _reported = True
        print(
            f"smartckpt: zero-code checkpointing off ({what}: {type(err).__name__}: {err})", file=sys.stderr
        )


# ---------------------------------------------------------------------------- heartbeat

_beat_writer: Any = None
_beat_pid = -1


def _heart() -> Any:
    global _beat_writer, _beat_pid
    if _beat_pid == os.getpid():
        return _beat_writer
    _beat_pid, _beat_writer = os.getpid(), None
    run_dir = _run_dir()
    if run_dir is None:
        return None
    try:
        _beat_writer = _protocol().HeartbeatWriter(run_dir, rank=int(os.environ.get("RANK", "-1")))
    except (OSError, ValueError, ImportError) as err:
        logger.warning("no heartbeat: %s", err)
        return None
    pid = os.getpid()

    def done() -> None:
        # Zero-code mode says DONE itself, after its final checkpoint.
        if os.getpid() == pid and _zc is None and not _hooks_state().get("uncaught"):
            _beat_writer.beat(state=_protocol().DONE)

    _register_exit(done)
    return _beat_writer


def beat(
    step: int | None = None,
    loss: float | None = None,
    committed_step: int | None = None,
    state: str | None = "TRAINING",
) -> None:
    """One heartbeat (a 64-byte pwrite) when running under ``smartckpt run``; else nothing.
    ``loss`` only when it is already on the host: a heartbeat never synchronises the device.
    ``state``: a state name of the protocol (``None`` keeps the current one)."""
    w = _heart()
    if w is not None:
        code = getattr(_protocol(), state) if state is not None else None
        w.beat(step=step, loss=loss, state=code, committed_step=committed_step)


@contextlib.contextmanager
def heartbeat_state(name: str, step: int | None = None) -> Iterator[None]:
    """``SAVING`` or ``RESTORING`` while a blocking save or restore runs (the supervisor pauses hang
    detection); the previous state afterwards."""
    w = _heart()
    if w is None:
        yield
        return
    previous = w.state
    w.beat(step=step, state=getattr(_protocol(), name))
    try:
        yield
    finally:
        w.beat(state=previous)


# ---------------------------------------------------------------------------- hooks


_installed = False
_last_loss: torch.Tensor | None = None
_zc: _ZeroCode | None = None
_off = False  # stood down (a user manager, several ranks) or disabled by an internal error
_creating_own = False


def install_hooks() -> None:
    """Global optimizer step hooks and the ``backward`` wrapper; idempotent, and only under
    ``smartckpt run`` (``SMARTCKPT_RUN_DIR`` set)."""
    global _installed
    if _installed or _run_dir() is None:
        return
    _installed = True
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_pre_hook)
    register_optimizer_step_post_hook(_post_hook)
    torch.Tensor.backward = _remember_loss(torch.Tensor.backward)  # type: ignore[method-assign]
    torch.autograd.backward = _remember_loss(torch.autograd.backward)


def _remember_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        global _last_loss
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            _last_loss = tensors.detach()  # a view: no copy, no host sync
        return fn(tensors, *args, **kwargs)

    backward.__doc__, backward.__name__ = fn.__doc__, fn.__name__
    backward.__wrapped__ = fn  # type: ignore[attr-defined]
    return backward


def _pre_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if _off:
        return
    try:
        zc = _zc if _zc is not None else _arm(via_start_step=False)
        if zc is not None:
            zc.before_step(optimizer)
    except Exception as err:
        _disable("optimizer step", err)


def _post_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if _beat_only is not None:
        _beat_only.after_step(optimizer)
        return
    if _off or _zc is None:
        return
    try:
        _zc.after_step(optimizer)
    except Exception as err:
        _disable("optimizer step", err)


def _disable(what: str, err: BaseException) -> None:
    global _off, _zc
    _report(what, err)
    logger.debug("zero-code checkpointing disabled", exc_info=err)
    _off = True
    zc, _zc = _zc, None
    if zc is not None:
        with contextlib.suppress(Exception):
            zc.mgr.close()


def manager_created(manager: Any) -> None:
    """Called by every CheckpointManager as it is built: one the user builds turns zero-code mode
    off in this process (its own manager would hold the store's writer lock)."""
    global _off, _zc
    if _creating_own or _off:
        return
    _off = True
    zc, _zc = _zc, None
    if zc is not None:
        logger.warning("a CheckpointManager was created: zero-code checkpointing stands down")
        zc.mgr.close()


def start_step() -> int:
    """The step to start a plain loop from. Under ``smartckpt run``: the step of the newest verified
    checkpoint, restored into the model(s), optimizer(s), schedulers, RNG and DataLoaders found
    in this process (0 on a first run). Outside it, or when the script builds its own
    CheckpointManager: 0 (or what a manager set with :func:`set_active_manager` restores).

    Call it after the model, optimizer and schedulers are built (and moved to their device), and
    before the first step."""
    if _active is not None:
        return int(_active.restore())
    if _run_dir() is None or _off:
        return 0
    try:
        install_hooks()
        zc = _zc if _zc is not None else _arm(via_start_step=True)
    except Exception as err:
        _disable("start_step", err)
        return 0
    if zc is None:
        if not _off:
            logger.warning(
                "smartckpt: start_step() found no optimizer: call it after building the model, "
                "optimizer and schedulers; nothing restored"
            )
        return 0
    return zc.restore()  # errors of a restore are the user's to see (never start over silently)


# ---------------------------------------------------------------------------- zero-code mode


def _arm(*, via_start_step: bool) -> _ZeroCode | None:
    global _zc, _off
    global _beat_only
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        logger.warning(
            "smartckpt: zero-code checkpointing covers one process; WORLD_SIZE=%d: only the heartbeat runs",
            world,
        )
        _off = True
        _beat_only = _StepCounter()
        return None
    found = _discover(with_loaders=via_start_step)
    if not found.optimizers:
        return None
    _zc = _ZeroCode(found)
    if not via_start_step:
        logger.warning(
            "smartckpt: the loop does not call smartckpt_cli.start_step(): checkpoints are written, "
            "but a restart begins again at step 0"
        )
    return _zc


class _StepCounter:
    """Heartbeat without checkpointing: counts the steps of the first optimizer that steps."""

    def __init__(self) -> None:
        self.primary: Any = None
        self.step = 0

    def after_step(self, optimizer: Any) -> None:
        if self.primary is None:
            self.primary = optimizer
        if optimizer is self.primary:
            self.step += 1
            beat(self.step)


_beat_only: _StepCounter | None = None


@dataclass
class _Found:
    """What zero-code mode checkpoints, in a stable order (names must match across restarts)."""

    optimizers: list[Any] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)


def _discover(*, with_loaders: bool) -> _Found:
    """Find the training objects among the live ones. Optimizers are ordered by their parameters'
    shapes (stable across runs of one script), modules by where their parameters appear in the
    optimizers, schedulers by their optimizer; only top-level modules are kept."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.utils.data import DataLoader

    scaler_types = tuple(
        t for t in (getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)) if t
    )
    opts, mods, scheds, scalers, loaders = [], [], [], [], []
    for o in gc.get_objects():
        t = type(o)  # not isinstance: that reads __class__, which some objects warn about
        if issubclass(t, torch.optim.Optimizer):
            opts.append(o)
        elif issubclass(t, torch.nn.Module):
            mods.append(o)
        elif issubclass(t, LRScheduler | ReduceLROnPlateau):
            scheds.append(o)
        elif scaler_types and issubclass(t, scaler_types):
            scalers.append(o)
        elif with_loaders and issubclass(t, DataLoader):
            loaders.append(o)
    opts.sort(key=lambda o: (type(o).__name__, [tuple(p.shape) for g in o.param_groups for p in g["params"]]))
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
    scalers = [s for s in scalers if s.is_enabled()]
    return _Found(opts, top, scheds, scalers, loaders)


def _names(base: str, objs: list[Any]) -> list[str]:
    return [base] if len(objs) == 1 else [f"{base}{i}" for i in range(len(objs))]


@dataclass
class _Record:
    """The state of iteration N that iteration N+1's forward/backward changes (post-hook N)."""

    step: int
    loss: torch.Tensor | None
    states: dict[str, Any]  # "rng" and each DataLoader's name -> state_dict


class _Recorded:
    """A registered object whose ``state_dict`` is the one recorded at the last post-hook."""

    def __init__(self, live: Any, name: str, zc: _ZeroCode) -> None:
        self.live, self.name, self.zc = live, name, zc

    def state_dict(self) -> Any:
        rec = self.zc.saving
        return rec.states[self.name] if rec is not None else self.live.state_dict()

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


class _ZeroCode:
    def __init__(self, found: _Found) -> None:
        global _creating_own
        from smartckpt_cli.config import load_settings
        from smartckpt_cli.manager import CheckpointManager
        from smartckpt_cli.registry import adapt
        from smartckpt_cli.rng import RNGState

        settings, _ = load_settings(os.environ.get("SMARTCKPT_CONFIG") or None)
        _creating_own = True
        try:
            self.mgr = CheckpointManager(config=settings)
        finally:
            _creating_own = False
        self.optimizers = found.optimizers
        self.primary: Any = None
        self.step = 0
        self.pending: _Record | None = None
        self.saving: _Record | None = None  # the record a snapshot reads, while it is taken
        self.started = False
        self.modules = [_BoundaryModule(m) for m in found.modules]
        self.live: dict[str, Any] = {"rng": RNGState()}
        # The manager's objects are set directly for the wrapped ones: they keep the kind of what
        # they wrap (module checks and tiers on restore), which ``register`` would not see.
        objects = self.mgr._objects
        objects["rng"] = ("rng", _Recorded(self.live["rng"], "rng", self))
        for name, w in zip(_names("model", self.modules), self.modules, strict=True):
            objects[name] = ("module", w)
        self.mgr.register(**dict(zip(_names("optimizer", found.optimizers), found.optimizers, strict=True)))
        self.mgr.register(**dict(zip(_names("scheduler", found.schedulers), found.schedulers, strict=True)))
        self.mgr.register(**dict(zip(_names("scaler", found.scalers), found.scalers, strict=True)))
        for name, loader in zip(_names("data", found.loaders), found.loaders, strict=True):
            kind, state = adapt(loader)
            self.live[name] = state
            objects[name] = (kind, _Recorded(state, name, self))
        self.ids = {id(o) for o in self.optimizers}
        self.posts: dict[int, int] = {}  # post-hooks seen, per optimizer
        self.scalers = found.scalers
        for scaler in self.scalers:
            self._count_skipped_steps(scaler)
        logger.info(
            "zero-code checkpointing: %s", ", ".join(n for n in objects if n != "rng") or "nothing found"
        )
        pid = os.getpid()
        _register_exit(lambda: self.finish() if os.getpid() == pid else None)

    def restore(self) -> int:
        if self.started or self.step:
            logger.warning("start_step() called after training started: nothing restored")
            return self.step
        self.started = True
        with heartbeat_state("RESTORING"):
            self.step = self.mgr.restore()
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
            if _zc is self and id(optimizer) in self.ids and self.posts.get(id(optimizer), 0) == before:
                try:
                    self.before_step(optimizer)
                    self.after_step(optimizer)
                except Exception as err:
                    _disable("GradScaler step", err)
            return out

        scaler.step = step

    def after_step(self, optimizer: Any) -> None:
        if id(optimizer) not in self.ids:
            return
        self.started = True
        self.posts[id(optimizer)] = self.posts.get(id(optimizer), 0) + 1
        if optimizer is self.primary:
            self.step += 1
            beat(self.step)
        states = {name: obj.state_dict() for name, obj in self.live.items()}
        for m in self.modules:
            m.record()
        loss = _last_loss
        scale = getattr(self.scalers[0], "_scale", None) if self.scalers else None
        if loss is not None:
            if isinstance(scale, torch.Tensor):
                loss = loss / scale.reshape(loss.shape)  # the scaled loss was backpropagated
            loss = loss.reshape(())  # device ops only: no sync
        self.pending = _Record(self.step, loss, states)

    def before_step(self, optimizer: Any) -> None:
        if id(optimizer) not in self.ids:
            return
        if self.primary is None:
            self.primary = optimizer
        if optimizer is not self.primary or self.pending is None:
            return
        rec, self.pending = self.pending, None
        if not all([m.check() for m in self.modules]):
            return  # a buffer forward mutates was just discovered: from the next step on it is exact
        self.saving = rec
        try:
            self.mgr.step(rec.step, loss=rec.loss)
        finally:
            self.saving = None

    def finish(self) -> None:
        """At interpreter exit: a final checkpoint after a clean run, then close the manager."""
        global _zc
        if _zc is not self:
            return
        _zc = None
        rec, self.pending = self.pending, None
        try:
            if (
                rec is not None
                and not _hooks_state().get("uncaught")
                and all([m.check() for m in self.modules])
            ):
                self.saving = rec
                try:
                    with heartbeat_state("SAVING"):
                        self.mgr.save(rec.step, reason="final", blocking=True)
                finally:
                    self.saving = None
        except Exception as err:
            _report("final checkpoint", err)
        finally:
            with heartbeat_state("SAVING"):
                self.mgr.close()
            if not _hooks_state().get("uncaught"):
                beat(state="DONE")
