"""Helpers shared by the tests: written once here, used by name."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Deterministic cuBLAS for the CUDA tests: read when CUDA initialises, so set before any test runs
# (harmless without a GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, at most 4. The end-to-end tests start two or three ranks
    each; on a big machine 16 workers would start 48 trainings whose timeouts assume far fewer."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


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


def clean_env(mp: pytest.MonkeyPatch, cwd: Path) -> None:
    """No stray ``SMARTCKPT_*`` settings, and ``cwd`` as the working directory. The fault
    explorer's summary file is kept: its harness sets it around the whole run."""
    for name in [n for n in os.environ if n.startswith("SMARTCKPT_") and n != "SMARTCKPT_FAULT_SUMMARY"]:
        mp.delenv(name)
    mp.chdir(cwd)


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A test that runs managers in this process: no stray settings, its own working directory,
    and the RNG states ``restore()`` loads into the process put back afterwards."""
    clean_env(monkeypatch, tmp_path)
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by the demo's training script: 30 steps, a checkpoint every 5, all six
    kept (keep_last 10) so that prune and rollback have something to work on. Read-only: copy it
    (``store_copy``) before changing it."""
    from smartckpt_cli.ops.demo_train import main as train

    path = tmp_path_factory.mktemp("demo-store") / "store"
    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, path.parent)
        mp.setenv("SMARTCKPT_KEEP_LAST", "10")
        assert train(["--dir", str(path), "--steps", "30", "--save-every", "5"]) == 0
    return path


@pytest.fixture
def store_copy(demo_store: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "store"
    shutil.copytree(demo_store, dst)
    return dst


@pytest.fixture
def area(tmp_path):
    """A RAM area as smartckpt run makes it: in /dev/shm when there is one (a tmpfs), removed after."""
    import subprocess

    from smartckpt_cli.store.names import ram_area

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    where = base / ram_area(f"test-{os.getpid()}-{tmp_path.name}")
    where.mkdir()
    yield where
    subprocess.run(["rm", "-rf", str(where)], check=False)
