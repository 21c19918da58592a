"""The spare interpreter of a warm restart (``python -m smartckpt_cli.agent.warm``, started by
``supervise/warm.py``, which holds the other end of its control socket and says why it exists).

Protocol, one JSON object a line on the socket whose descriptor ``SMARTCKPT_WARM_FD`` names:

1. once torch and smartckpt are imported: ``{"ready": pid, "imported": seconds, "rss": bytes}``
   (or ``{"error": line}`` and exit 3);
2. the supervisor sends ``{"run": {"target", "module", "args", "cwd", "orig_argv", "env"}}``;
3. this process answers ``{"running": pid}`` (or ``{"refused": line}`` and exit 3), closes the
   socket and becomes the attempt: the attempt's environment, working directory, ``sys.argv``
   and ``sys.path[0]``, the hooks activated (``hooks/sitecustomize.py``: the files named by this
   pid, the optimizer hooks, since torch is imported already), then the script run as ``python
   script.py`` (or ``python -m module``) would run it. Its exceptions, ``sys.exit`` and exit
   status are the script's own; the frames of this module are cut from a traceback.

Nothing here touches a GPU or runs a torch operation before the script does: the spare must be
what a fresh interpreter is, plus modules already imported.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from typing import Any

__all__ = ["main"]

ENV_FD = "SMARTCKPT_WARM_FD"


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _wait(sock: socket.socket) -> dict[str, Any] | None:
    """The run request; None when the supervisor is gone (the socket closed)."""
    buf = b""
    while b"\n" not in buf:
        try:
            data = sock.recv(1 << 16)
        except OSError:
            return None
        if not data:
            return None
        buf += data
    msg = json.loads(buf.split(b"\n", 1)[0])
    req = msg.get("run") if isinstance(msg, dict) else None
    return req if isinstance(req, dict) else None


def _become(req: dict[str, Any]) -> None:
    """The attempt's environment, directory, argv, path and hooks."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    target, args = str(req["target"]), [str(a) for a in req["args"]]
    if req["module"]:
        sys.argv = ["-m", *args]  # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    sys.orig_argv = [str(a) for a in req["orig_argv"]]
    hooks = sys.modules.get("sitecustomize")
    activate = getattr(hooks, "_activate", None)
    state = getattr(sys, "_smartckpt_hooks", None)
    run_dir = os.environ.get("SMARTCKPT_RUN_DIR")
    if run_dir and activate is not None and isinstance(state, dict) and not state.get("active"):
        activate(run_dir)  # the hooks file, excepthooks, stack dumps, the optimizer hooks
        state["active"] = True


def _run(req: dict[str, Any]) -> None:
    import runpy

    if req["module"]:
        runpy.run_module(str(req["target"]), run_name="__main__", alter_sys=True)
        return
    # What the interpreter does for `python script.py` (runpy.run_path would put the path it is
    # given into sys.argv[0]): a fresh __main__ with an absolute __file__, the code compiled from
    # the file's bytes (its coding cookie honoured), run in it.
    import builtins
    import importlib.machinery
    import io
    import types

    path = os.path.abspath(str(req["target"]))
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _ours(tb: Any) -> bool:
    import runpy

    name = tb.tb_frame.f_code.co_filename
    return name in (__file__, runpy.__file__) or name.startswith("<frozen runpy")


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop(ENV_FD)))
    t0 = time.perf_counter()
    try:
        import torch  # (what a warm restart skips)

        import smartckpt_cli.agent.runtime
        import smartckpt_cli.agent.zerocode
        import smartckpt_cli.engine.manager  # noqa: F401
    except BaseException as err:  # the supervisor starts the attempt cold and says why
        _send(sock, {"error": f"importing: {type(err).__name__}: {err}"})
        raise SystemExit(3) from None
    try:
        # What the script's first optimizer imports (torch.optim loads torch._dynamo when the
        # first one is built: 1 s here, as long as torch itself on some machines).
        import torch._dynamo
    except Exception:
        pass  # a torch without it: the script imports what it needs itself
    if torch.cuda.is_initialized():  # a CUDA context must be the script's own, made after it starts
        _send(sock, {"error": "CUDA was initialised while importing"})
        raise SystemExit(3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _send(sock, {"ready": os.getpid(), "imported": round(time.perf_counter() - t0, 3), "rss": rss})
    req = _wait(sock)
    if req is None:
        return
    try:
        _become(req)
    except Exception as err:
        _send(sock, {"refused": f"{type(err).__name__}: {err}"})
        raise SystemExit(3) from None
    _send(sock, {"running": os.getpid()})
    sock.close()
    try:
        _run(req)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:
        # What `python script.py` prints and does: the traceback from the script's frame on
        # (the hooks' excepthook writes the error file), exit status 1.
        tb = err.__traceback__
        while tb is not None and _ours(tb):
            tb = tb.tb_next
        # (the interpreter prints an exception's own traceback, not the one it is handed)
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
