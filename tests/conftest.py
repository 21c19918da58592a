from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for child Python processes: unbuffered, the package importable, no stray
    smartckpt settings or fault switches from the outer environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def python() -> str:
    return sys.executable
