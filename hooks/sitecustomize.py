"""smartckpt's bootstrap, imported by the interpreter at start-up because ``smartckpt run`` puts this
directory first on PYTHONPATH. Standard library only: it runs before anything else, in every Python
process of the job (the torchrun agent, its workers, DataLoader workers started with ``spawn``).

What it does, in order, and never more than once per process:

1. Chains to the ``sitecustomize`` it shadows (the user's further along PYTHONPATH, or the
   distribution's in site-packages): this directory is taken off ``sys.path``, the module cache
   entry dropped and ``sitecustomize`` imported again, then both are put back. Python only ever
   imports one ``sitecustomize``, so without this the user's would silently stop running.
2. When ``SMARTCKPT_RUN_DIR`` is set (the supervisor's handshake, see ``_smartckpt_protocol``):
   writes ``hooks.<pid>.json`` (the hooks are live), installs ``sys.excepthook`` and
   ``threading.excepthook`` wrappers that write ``error.<pid>.json`` before handing on (a
   SyntaxError in the main script goes through ``sys.excepthook`` too), registers ``faulthandler``
   on SIGQUIT to dump every thread's stack into ``stacks.<pid>.txt``, and installs an import
   watcher: once ``torch`` has been imported, ``smartckpt_cli.agent.runtime.install_hooks()`` adds the
   global optimizer step hooks and the ``backward`` wrapper; once a Hugging Face or Lightning
   trainer module has been imported, ``smartckpt_cli.integrations.auto`` gives its Trainer
   smartckpt's callback. Nothing else happens until an
   optimizer steps, so processes that never train (the torchrun agent, DataLoader workers) stay
   untouched.

The guard against running twice is a flag in this process's ``sys`` module, not an environment
variable: children (torchrun workers, subprocesses) must run the hooks again. A second copy of
this file further along the path (two installs) still chains onward but adds no second set of
hooks. Any failure here is reported once on stderr and the program runs on without the hooks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_FLAG = "_smartckpt_hooks"  # attribute on the sys module: this process already ran the hooks
_here = os.path.dirname(os.path.abspath(__file__))
_reported = False


def _report(what: str, err: BaseException) -> None:
    global _reported
    if _reported:
        return
    _reported = True
    try:
        sys.stderr.write(
            f"smartckpt: hooks disabled ({what}: {type(err).__name__}: {err}); running without them\n"
        )
    except Exception:
        pass


def _same_dir(entry: str) -> bool:
    try:
        return os.path.realpath(entry or os.getcwd()) == os.path.realpath(_here)
    except (OSError, ValueError):
        return False


def _chain() -> object | None:
    """Import the sitecustomize this one shadows, if any; returns it."""
    import importlib

    me = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    positions = [i for i, p in enumerate(saved) if _same_dir(p)]
    sys.path[:] = [p for p in saved if not _same_dir(p)]
    sys.modules.pop("sitecustomize", None)
    try:
        return importlib.import_module("sitecustomize")
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            _report_chain(err)
        return None
    except Exception as err:
        _report_chain(err)
        return None
    finally:
        # Put our directory back where it was (what the chained module added to sys.path stays).
        for i in positions:
            sys.path.insert(min(i, len(sys.path)), saved[i])
        if me is not None:
            sys.modules["sitecustomize"] = me


def _report_chain(err: BaseException) -> None:
    # What site.py itself prints when a sitecustomize fails; the user's error is not ours.
    try:
        sys.stderr.write(f"Error in sitecustomize (chained by smartckpt); {type(err).__name__}: {err}\n")
    except Exception:
        pass


def _activate(run_dir: str) -> None:
    import time

    import _smartckpt_protocol as proto
    from _smartckpt_redact import redact_argv  # a --hf-token=... never lands on disk

    pid = os.getpid()
    proto.write_json(
        proto.hooks_path(run_dir, pid),
        {
            "pid": pid,
            "ppid": os.getppid(),
            "argv": redact_argv(list(sys.argv)),
            "orig_argv": redact_argv(list(getattr(sys, "orig_argv", sys.argv))),
            "python": sys.executable,
            "python_version": sys.version.split()[0],
            "hooks": _here,
            "run_id": os.environ.get(proto.ENV_RUN_ID),
            "attempt": os.environ.get(proto.ENV_ATTEMPT),
            "time": time.time(),
        },
    )
    _install_error_hooks(run_dir, proto)
    _install_stack_dump(run_dir, proto)
    _install_torch_watcher()


# ---------------------------------------------------------------------------- errors


def _write_error(
    run_dir: str, proto: Any, exc_type: type, exc: BaseException, tb: object, thread: str | None
) -> None:
    import time
    import traceback

    payload = {
        "type": getattr(exc_type, "__name__", str(exc_type)),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        "time": time.time(),
    }
    if thread is not None:
        payload["thread"] = thread
    failures = _rank_failures(exc)
    if failures:
        payload["failures"] = failures
    proto.write_json(proto.error_path(run_dir, os.getpid()), payload)


def _rank_failures(exc: BaseException) -> list:
    """torchrun's agent ends with ``ChildFailedError``, whose ``failures`` say how each rank that
    failed ended (its exit code or signal, its pid, when): ``smartckpt run`` names the rank that
    died first from them, not a peer that lost its connection to it."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    import signal

    out = []
    for rank, f in failures.items():
        code = getattr(f, "exitcode", None)
        if not isinstance(rank, int) or not isinstance(code, int):
            continue
        name = None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
        out.append(
            {
                "rank": rank,
                "local_rank": getattr(f, "local_rank", None),
                "pid": getattr(f, "pid", None),
                "exitcode": code,
                "signal": name,
                "time": getattr(f, "timestamp", None),
            }
        )
    return out


def _install_error_hooks(run_dir: str, proto: Any) -> None:
    import threading

    previous = sys.excepthook

    def excepthook(exc_type: type, exc: BaseException, tb: object) -> None:
        state["uncaught"] = True
        try:
            _write_error(run_dir, proto, exc_type, exc, tb, None)
        except Exception:
            pass
        if _stopped_by_signal(exc):
            return  # a stop the user asked for: the supervisor says it in one line
        previous(exc_type, exc, tb)

    previous_thread = threading.excepthook

    def thread_excepthook(args: Any) -> None:
        try:
            if args.exc_type is not SystemExit:
                name = getattr(args.thread, "name", None)
                _write_error(
                    run_dir, proto, args.exc_type, args.exc_value, args.exc_traceback, name or "thread"
                )
        except Exception:
            pass
        previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def _stopped_by_signal(exc: BaseException) -> bool:
    """torchrun's agent ends with ``SignalException`` when SIGINT or SIGTERM (Ctrl-C, or the
    supervisor passing one on) stopped it after it passed the signal to its workers: a stop, not
    an error, so no traceback (its workers saved and said so)."""
    import signal

    if type(exc).__name__ != "SignalException" or not type(exc).__module__.startswith("torch.distributed"):
        return False
    return getattr(exc, "sigval", None) in (signal.SIGINT, signal.SIGTERM)


def _install_stack_dump(run_dir: str, proto: Any) -> None:
    import faulthandler
    import signal

    signum = getattr(signal, proto.STACK_SIGNAL_NAME, None)
    if signum is None:
        return
    # faulthandler writes from its C signal handler, so the file must be open beforehand; it works
    # even when the hung thread holds the GIL or sits in C code.
    f = open(proto.stacks_path(run_dir, os.getpid()), "a", encoding="utf-8")  # noqa: SIM115
    state["stacks_file"] = f
    faulthandler.register(signum, file=f, all_threads=True, chain=False)


# ---------------------------------------------------------------------------- torch watcher


class _TorchWatcher:
    """A ``sys.meta_path`` finder that does not find anything itself: when ``torch`` (or the module
    it is given) is about to be imported it lets the other finders locate it and wraps that
    loader's ``exec_module`` so that, once the module is fully initialised, ``then(module)`` runs
    (for torch: the runtime installs its hooks). Removes itself after that."""

    def __init__(self, name: str = "torch", then: Any = None) -> None:
        self.name = name
        self.then = then if then is not None else (lambda _module: _torch_loaded())

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.remove()
        try:
            return self._watch(fullname, path, target)
        except Exception as err:  # the normal import machinery goes on without us
            _report("watching the torch import", err)
            return None

    def _watch(self, fullname: str, path: Any, target: Any) -> Any:
        spec = None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or exec_module is None:
            return spec

        def exec_and_hook(module: Any) -> None:
            try:
                del loader.exec_module  # this loader instance only, and only once
            except AttributeError:
                pass
            exec_module(module)
            self.then(module)

        loader.exec_module = exec_and_hook
        return spec

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _torch_loaded() -> None:
    try:
        from smartckpt_cli.agent import runtime

        runtime.install_hooks()
    except Exception as err:
        _report("installing the torch hooks", err)


# The trainers whose classes get smartckpt's callback (smartckpt_cli.integrations.auto).
_TRAINER_MODULES = (
    "transformers.trainer",
    "pytorch_lightning.trainer.trainer",
    "lightning.pytorch.trainer.trainer",
)


class _TrainerWatcher(_TorchWatcher):
    """The same watcher for a trainer module (its own name, so the torch watcher stays countable)."""


def _trainer_loaded(module: Any) -> None:
    try:
        from smartckpt_cli.integrations import auto

        auto.patch(module)
    except Exception as err:
        _report("adding the trainer callback", err)


def _install_torch_watcher() -> None:
    for name in _TRAINER_MODULES:
        if name in sys.modules:
            _trainer_loaded(sys.modules[name])
        else:
            sys.meta_path.insert(0, _TrainerWatcher(name, _trainer_loaded))
    if "torch" in sys.modules:
        _torch_loaded()
        return
    sys.meta_path.insert(0, _TorchWatcher())


# ---------------------------------------------------------------------------- start-up


state: dict[str, object] = {}


def _main() -> None:
    first = getattr(sys, _FLAG, None) is None
    if first:
        setattr(sys, _FLAG, state)
    # Chain even when a copy of us already ran: the sitecustomize further along must still run.
    state_chained = _chain()
    if first:
        state["chained"] = state_chained
        run_dir = os.environ.get("SMARTCKPT_RUN_DIR")
        if run_dir:
            try:
                _activate(run_dir)
                state["active"] = True
            except Exception as err:
                _report("start-up", err)


try:
    _main()
except Exception as _err:  # never break the user's program
    _report("start-up", _err)
