"""What runs inside the training process when smartckpt is injected (``smartckpt run``).

``hooks/sitecustomize.py`` calls :func:`install_hooks` once ``torch`` has been imported, and only
when ``SMARTCKPT_RUN_DIR`` is set. That adds two global optimizer step hooks and a wrapper on
``backward`` that remembers the last scalar loss (detached, no host sync). Nothing more happens
until an optimizer steps (or the script calls :func:`start_step`): processes that never train stay
untouched. Then **zero-code mode** arms: it finds the optimizers (``gc``), the top-level modules
owning their parameters, the LR schedulers attached to them, an enabled GradScaler and (from
``start_step`` only, before their first epoch) the DataLoaders, and checkpoints them with a
:class:`~smartckpt_cli.engine.manager.CheckpointManager` built from the settings (``SMARTCKPT_*``).

How the checkpoint of step N is made exact (which state is taken at which hook) is
described in :mod:`smartckpt_cli.agent.zerocode`.

:func:`start_step` restores the newest verified checkpoint into the discovered objects and returns
its step; outside ``smartckpt run`` it returns 0 (or restores through a manager set with
:func:`set_active_manager`). A script that creates its own ``CheckpointManager`` turns zero-code
mode off in that process (two managers cannot write one store); the heartbeat still beats from
``CheckpointManager.step``.

Under torchrun (``WORLD_SIZE`` > 1) zero-code mode arms on every rank once torch.distributed is
initialised, and takes its final checkpoint before ``destroy_process_group``; without an
initialised world it stands down and only the heartbeat runs. Limits: modules must be on their device before ``start_step`` (buffers are tracked by
reference); a DataLoader iterated before ``start_step`` cannot be repositioned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from smartckpt_cli.agent.nooptimizer import NoOptimizer, say_no_optimizer
from smartckpt_cli.engine.heartbeat import (
    beat,
    heartbeat_state,
    hooks_state,
    protocol,
    register_exit,
    run_dir,
    set_done_at_exit,
    total_steps,
    trouble,
)
from smartckpt_cli.engine.report import note, report
from smartckpt_cli.errors import EXIT_REMOTE_UNREACHABLE, RemoteStartRefused

if TYPE_CHECKING:
    from smartckpt_cli.agent.zerocode import ZeroCode

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


_reported = False


def _report(what: str, err: BaseException) -> None:
    global _reported
    if not _reported:
        _reported = True
        print(
            f"smartckpt: zero-code checkpointing off ({what}: {type(err).__name__}: {err})", file=sys.stderr
        )


# ---------------------------------------------------------------------------- hooks


_installed = False
# The step's loss: the scalars backward() ran on since the last optimizer step, summed.
_last_loss: torch.Tensor | None = None
_fresh = True  # the next backward() starts a new step's loss
_zc: ZeroCode | None = None
_off = False  # stood down (a user manager, several ranks) or disabled by an internal error
_creating_own = False


def install_hooks() -> None:
    """Global optimizer step hooks and the ``backward`` wrapper; idempotent, and only under
    ``smartckpt run`` (``SMARTCKPT_RUN_DIR`` set)."""
    global _installed
    if _installed or run_dir() is None:
        return
    _installed = True
    # torch is imported and the hooks are in: the end of a start's "imports" phase (run record),
    # written with this process's first report
    note(torch_ready=time.time())
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    global _watch
    register_optimizer_step_pre_hook(_pre_hook)
    register_optimizer_step_post_hook(_post_hook)
    from smartckpt_cli.agent.naming import stamp_creation

    stamp_creation()  # a creation order, the same in every run, for zero-code's names
    _watch = NoOptimizer(_no_optimizer)
    torch.Tensor.backward = _remember_loss(torch.Tensor.backward)  # type: ignore[method-assign]
    torch.autograd.backward = _remember_loss(torch.autograd.backward)


def _remember_loss(fn: Callable[..., Any]) -> Callable[..., Any]:
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        global _last_loss, _fresh, _depth
        if _depth:  # Tensor.backward calls torch.autograd.backward: one backward pass, seen once
            return fn(tensors, *args, **kwargs)
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            t = tensors.detach()  # a view: no copy, no host sync; the graph is not held
            # Gradient accumulation backpropagates loss/k k times a step: their sum is the step's
            # loss (what the loop logs, the trigger reads and the status line shows).
            _last_loss = t if _fresh or _last_loss is None else _last_loss + t
            _fresh = False
            if _watch is not None:
                _watch.backward(tensors)
        _depth += 1
        try:
            out = fn(tensors, *args, **kwargs)
        finally:
            _depth -= 1
        if _watch is not None:
            _watch.after()
        return out

    backward.__doc__, backward.__name__ = fn.__doc__, fn.__name__
    backward.__wrapped__ = fn  # type: ignore[attr-defined]
    return backward


_depth = 0


def _no_optimizer(iterations: int) -> None:
    global _watch
    _watch = None  # said once
    if not _off:  # stood down or disabled: that was said already
        say_no_optimizer(iterations)


_watch: NoOptimizer | None = None


def _pre_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if _off:
        return
    try:
        zc = _zc if _zc is not None else _arm(via_start_step=False)
        if zc is not None:
            zc.before_step(optimizer)
    except RemoteStartRefused as err:
        _refuse_start(err)  # never train on from step 0 while the run's checkpoints may be on the remote
    except Exception as err:
        _disable("optimizer step", err)


def _loss_done() -> None:
    """A step ended (an optimizer stepped, or a GradScaler skipped its step): the next
    ``backward()`` begins the next step's loss."""
    global _fresh
    _fresh = True


def _post_hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    global _fresh, _watch
    _fresh, _watch = True, None  # the next backward() is the next step's; an optimizer steps
    if _beat_only is not None:
        _beat_only.after_step(optimizer)
        return
    if _off or _zc is None:
        return
    try:
        _zc.after_step(optimizer)
    except Exception as err:
        _disable("optimizer step", err)


def _refuse_start(err: RemoteStartRefused) -> NoReturn:
    """End this process with its one line and exit code 5: the run's checkpoints may be on a
    remote that cannot be reached, and training from step 0 would orphan them. The error file
    tells ``smartckpt run`` why (it stops, and says so); no traceback: nothing failed."""
    sys.stderr.write(f"smartckpt: {err}\n")
    where = run_dir()
    if where is not None:
        with contextlib.suppress(OSError):
            proto = protocol()
            proto.write_json(
                proto.error_path(where, os.getpid()),
                {"type": type(err).__name__, "message": str(err), "time": time.time()},
            )
    raise SystemExit(EXIT_REMOTE_UNREACHABLE)


def _disable(what: str, err: BaseException) -> None:
    """Zero-code checkpointing turns itself off (an error of its own it cannot step past): the
    training goes on, never in silence. Why goes into the journal, the heartbeat (a flag) and the
    report, so that ``smartckpt run`` shows it in its status line and exit summary and
    ``smartckpt inspect`` lists it; the heartbeat keeps beating the steps (hang detection and the
    lost-work count still hold)."""
    global _off, _zc, _beat_only
    _report(what, err)
    logger.debug("zero-code checkpointing disabled", exc_info=err)
    _off = True
    zc, _zc = _zc, None
    set_done_at_exit(True)
    why = f"{what}: {type(err).__name__}: {err}"[:300]
    step = zc.step if zc is not None else 0
    trouble("CHECKPOINTING_OFF", True)
    report(checkpointing_off={"why": why, "step": step})
    counter = _StepCounter()
    counter.primary, counter.step = (zc.primary, step) if zc is not None else (None, step)
    _beat_only = counter
    if zc is not None:
        zc.active = False
        with contextlib.suppress(Exception):
            zc.mgr.record_event({"event": "checkpointing_off", "step": step, "why": why})
        with contextlib.suppress(Exception):
            zc.mgr.close()


def manager_created(manager: Any) -> None:
    """Called for every CheckpointManager built once zero-code mode is armed (the engine's
    ``on_manager_created``): one the user builds turns zero-code mode off in this process (its
    own manager would hold the store's writer lock)."""
    global _off, _zc
    if _creating_own or _off:
        return
    _off = True
    zc, _zc = _zc, None
    set_done_at_exit(True)
    if zc is not None:
        logger.warning("a CheckpointManager was created: zero-code checkpointing stands down")
        zc.active = False
        zc.mgr.close()
        # What zero-code said of where the loop began (step 0, at an optimizer step before this
        # manager existed: a warm-up step) is not what happened: the script's own manager says
        # that when it restores.
        report(start_step=None, restored_from=None, start_step_called=None, checkpoint=None, lineage=None)


def start_step(total: int | None = None) -> int:
    """The step to start a plain loop from. Under ``smartckpt run``: the step of the newest verified
    checkpoint, restored into the model(s), optimizer(s), schedulers, RNG and DataLoaders found
    in this process (0 on a first run). Outside it, or when the script builds its own
    CheckpointManager: 0 (or what a manager set with :func:`set_active_manager` restores).

    Call it after the model, optimizer and schedulers are built (and moved to their device), and
    before the first step. ``total``: the steps the loop takes in all (``range(start, total)``);
    ``smartckpt run``'s live view then shows the progress and an ETA."""
    total_steps(total)
    if _active is not None:
        return int(_active.restore())
    if run_dir() is None or _off:
        return 0
    try:
        install_hooks()
        zc = _zc if _zc is not None else _arm(via_start_step=True)
    except RemoteStartRefused as err:
        _refuse_start(err)  # never a silent start over at step 0: smartckpt run stops with exit code 5
    except Exception as err:
        _disable("start_step", err)
        return 0
    if zc is None:
        if not _off:
            global _early
            _early = True
            logger.warning(
                "smartckpt: start_step() was called before any optimizer exists: nothing restored, "
                "so the loop begins at step 0 (a restart too); call it after building the model, "
                "optimizer and schedulers"
            )
            report(start_step=0, restored_from=None, start_step_called=True, start_step_early=True)
        return 0
    step = zc.restore()  # errors of a restore are the user's to see (never start over silently)
    report(start_step_called=True, start_step_early=False)
    return step


_early = False  # start_step() came before any optimizer existed (said once, then)


# ---------------------------------------------------------------------------- zero-code mode


def _arm(*, via_start_step: bool) -> ZeroCode | None:
    global _zc, _off, _beat_only, _creating_own
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and not _dist_ready():
        # Under torchrun zero-code mode arms once torch.distributed is initialised (it is by the
        # first optimizer step of a DDP/FSDP loop); every rank then coordinates through it.
        logger.warning(
            "smartckpt: WORLD_SIZE=%d but torch.distributed is not initialised at the first optimizer "
            "step: zero-code checkpointing stands down, only the heartbeat runs",
            world,
        )
        _off = True
        _beat_only = _StepCounter()
        return None
    from smartckpt_cli.agent.zerocode import ZeroCode, discover
    from smartckpt_cli.config import load_settings
    from smartckpt_cli.engine import manager as engine_manager
    from smartckpt_cli.engine.manager import CheckpointManager

    if engine_manager.managers_built() > 0:
        # the script built its own CheckpointManager before the first step: it checkpoints
        _off = True
        return None
    found = discover(with_loaders=via_start_step)
    if not found.optimizers:
        return None
    settings, _ = load_settings(os.environ.get("SMARTCKPT_CONFIG") or None)
    _creating_own = True
    try:
        mgr = CheckpointManager(config=settings)
    finally:
        _creating_own = False
    mgr.heartbeat = False  # zero-code mode beats each step from its post-hook
    _zc = ZeroCode(found, mgr, loss=lambda: _last_loss, on_error=_disable, loss_done=_loss_done)
    set_done_at_exit(False)  # _finish says DONE after the final checkpoint
    engine_manager.on_manager_created(manager_created)  # a manager built later stands us down
    if world > 1:  # the final checkpoint needs the world: take it before the group is destroyed
        from smartckpt_cli.engine.distributed import guard_destroy

        guard_destroy(mgr, before=_finish)
    pid = os.getpid()
    register_exit(lambda: _finish() if os.getpid() == pid else None)
    if not via_start_step:
        # start_step() was not called before the first optimizer step: the loop began at step 0.
        report(start_step=0, restored_from=None, start_step_called=_early, lineage=mgr.lineage)
        if not _early:  # an early start_step() has said so already
            logger.warning(
                "smartckpt: the loop does not call smartckpt_cli.start_step(): checkpoints are "
                "written, but a restart begins again at step 0"
            )
    return _zc


def _dist_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _finish() -> None:
    """At interpreter exit: zero-code mode's final checkpoint, then DONE."""
    global _zc
    zc, _zc = _zc, None
    if zc is None:
        return
    clean = not hooks_state().get("uncaught")
    try:
        zc.finish(final_save=clean)
    except Exception as err:
        _report("final checkpoint", err)
    if clean:
        beat(state="DONE")


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
