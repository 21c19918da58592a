"""The run's L5 metadata: what every checkpoint of this process records about where it ran.

Host, pid, world size, git commit of the working directory, and the versions of smartckpt, torch
and Python: taken once when the manager starts, since none of it changes during a run. Separate
from ``engine/writer.py``, which writes whatever metadata the snapshot carries and knows nothing
of where it comes from.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from functools import lru_cache
from typing import Any

import torch

__all__ = ["base_meta"]


@lru_cache(maxsize=1)
def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def base_meta() -> dict[str, Any]:
    """L5 metadata that does not change during a run."""
    from smartckpt_cli.version import __version__

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "world_size": world,
        "git_commit": _git_commit(),
        "versions": {
            "smartckpt": __version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
    }
