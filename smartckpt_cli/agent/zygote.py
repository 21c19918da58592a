"""The warm interpreter of ``smartckpt run`` (a fork server): torch and smartckpt imported, no CUDA
context, waiting to run the training script. ``python -m smartckpt_cli.agent.zygote`` (started by
``supervise/warm.py``, which holds the other end of its control socket).

Protocol: one JSON object a line on the socket whose descriptor ``SMARTCKPT_WARM`` names.

1. at start: ``{"ready": pid, "python": ..., "imported": seconds}`` or ``{"error": line}``;
2. the supervisor asks ``{"run": {"argv", "env", "cwd", "module"}}``; the server forks (refusing
   with ``{"refused": line}`` when CUDA is initialised in it: a CUDA context does not survive a
   fork) and answers ``{"forked": pid, "time": t}``;
3. ``{"exit": pid, "status": waitpid status, "time": t}`` when a forked process ends (the server
   is its parent and reaps it).

The forked process makes a session of its own (signals go to its whole group, as for a cold
child), takes the attempt's environment, working directory and ``sys.argv``, activates the run's
hooks (``hooks/sitecustomize.py``: the files named by its own pid, the optimizer hooks; torch is
already imported) and runs the script as ``python script.py`` would (``runpy``, ``__main__``);
its exceptions, ``sys.exit`` and interpreter exit are the script's own. The server itself stays
single-threaded (a fork copies only the forking thread) and never runs a torch operation (an
OpenMP team started before a fork hangs the child's).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from typing import Any

__all__ = ["main"]

ENV_FD = "SMARTCKPT_WARM"


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """The server loop; returns the run request in a forked child, None when told to stop."""
    import torch

    buf = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "status": status, "time": time.time()})
        if not ready:
            continue
        data = sock.recv(1 << 16)
        if not data:
            return None  # the supervisor is gone
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            req = msg.get("run")
            if req is None:
                return None
            if torch.cuda.is_initialized():
                _send(sock, {"refused": "CUDA was initialised in the warm interpreter before the fork"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return dict(req)
            children.add(pid)
            _send(sock, {"forked": pid, "time": time.time()})


def _become(req: dict[str, Any], forked: float) -> tuple[str, str]:
    """In the forked child: the attempt's session, environment, directory, argv and hooks."""
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = list(req["argv"])
    sys.argv = argv
    if req.get("module"):
        sys.path[0] = os.getcwd()
        target = argv[0]
        sys.argv = ["-m", *argv[1:]]  # what runpy puts there until the module is found
    else:
        target = argv[0]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    site = sys.modules.get("sitecustomize")
    run_dir = os.environ.get("SMARTCKPT_RUN_DIR")
    activate = getattr(site, "_activate", None)
    if run_dir and activate is not None:
        state = getattr(sys, "_smartckpt_hooks", None)
        activate(run_dir)
        if isinstance(state, dict):
            state["active"] = True
    from smartckpt_cli.engine.report import report

    report(warm=True, forked=forked, imported=forked)
    return target, "module" if req.get("module") else "script"


def main() -> None:
    fd = int(os.environ.pop(ENV_FD))
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    try:
        import torch  # noqa: F401  (what a restart skips)

        import smartckpt_cli.agent.runtime  # noqa: F401
        import smartckpt_cli.agent.zerocode  # noqa: F401
        import smartckpt_cli.engine.manager  # noqa: F401
    except BaseException as err:
        _send(sock, {"error": f"{type(err).__name__}: {err}"})
        raise SystemExit(3) from None
    _send(sock, {"ready": os.getpid(), "python": sys.executable, "imported": time.perf_counter() - t0})
    req = _serve(sock)
    if req is None:
        return
    forked = time.time()
    sock.close()
    target, mode = _become(req, forked)
    import runpy

    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
