"""Every example in examples/ runs small, and resumes when run again. (``plain_loop.py`` is run by
test_examples_cli.py and ``slurm/`` by test_slurm.py; not repeated here.) Each must finish well
under 60 s on a CPU; the whole-run time is asserted with room for a slow, shared machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
LIMIT = 60.0  # seconds per example (both of its runs)


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=LIMIT * 2)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def _timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    fn()
    took = time.monotonic() - t0
    print(f"{took:.1f} s")
    assert took < LIMIT, f"the example took {took:.1f} s (limit {LIMIT:.0f} s)"


def test_zero_code_example_under_run_resumes(tmp_path, child_env):
    def both() -> None:
        run = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "10",
               str(EXAMPLES / "zero_code.py")]  # fmt: skip
        first = _run([*run, "--steps", "30"], tmp_path, child_env)
        assert "starting at step 0" in first and "done at step 30" in first
        second = _run([*run, "--steps", "40"], tmp_path, child_env)
        assert "starting at step 30" in second and "done at step 40" in second  # the final checkpoint

    _timed(both)


def test_zero_code_example_runs_as_plain_pytorch(tmp_path, child_env):
    out = _run([sys.executable, str(EXAMPLES / "zero_code.py"), "--steps", "5"], tmp_path, child_env)
    assert "starting at step 0" in out and "done at step 5" in out


def test_hf_trainer_example_resumes_without_trainer_checkpoints(tmp_path, child_env):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def both() -> None:
        run = [sys.executable, str(EXAMPLES / "hf_trainer.py"), "--every", "10"]
        first = _run([*run, "--max-steps", "20"], tmp_path, child_env)
        assert "resumed from step 0" in first and "finished at global step 20" in first
        second = _run([*run, "--max-steps", "30"], tmp_path, child_env)
        assert "resumed from step 20" in second and "finished at global step 30" in second

    _timed(both)
    assert not list(tmp_path.rglob("checkpoint-*"))
    steps = sorted(int(p.name.split("-")[0]) for p in (tmp_path / "checkpoints" / "manifests").glob("*.json"))
    assert steps == [10, 20, 30]


def test_lightning_example_resumes_without_ckpt_files(tmp_path, child_env):
    pytest.importorskip("pytorch_lightning")

    def both() -> None:
        run = [sys.executable, str(EXAMPLES / "lightning_fit.py"), "--every", "10"]
        first = _run([*run, "--max-steps", "20"], tmp_path, child_env)
        assert "resumed from step 0" in first and "finished at global step 20" in first
        second = _run([*run, "--max-steps", "30"], tmp_path, child_env)
        assert "resumed from step 20" in second and "finished at global step 30" in second

    _timed(both)
    assert not list(tmp_path.rglob("*.ckpt"))


def _torchrun() -> str:
    return shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"


def test_ddp_example_one_rank_resumes(tmp_path, child_env):
    """The DDP script's own mechanics (process group, sampler epoch after a resume) with one rank,
    which needs no multi-rank support."""

    def both() -> None:
        run = [_torchrun(), "--standalone", "--nproc_per_node", "1", str(EXAMPLES / "ddp" / "train.py"),
               "--dir", "ck", "--every", "10"]  # fmt: skip
        first = _run([*run, "--steps", "20"], tmp_path, child_env)
        assert "rank 0 starting at step 0" in first and "rank 0 done at step 20" in first, first
        second = _run([*run, "--steps", "30"], tmp_path, child_env)
        assert "rank 0 starting at step 20" in second and "rank 0 done at step 30" in second, second

    _timed(both)


def test_ddp_example_two_ranks_resume(tmp_path, child_env):
    def both() -> None:
        run = [_torchrun(), "--standalone", "--nproc_per_node", "2", str(EXAMPLES / "ddp" / "train.py"),
               "--dir", "ck", "--every", "10"]  # fmt: skip
        first = _run([*run, "--steps", "20"], tmp_path, child_env)
        assert first.count("starting at step 0") == 2 and first.count("done at step 20") == 2, first
        second = _run([*run, "--steps", "30"], tmp_path, child_env)
        assert second.count("starting at step 20") == 2 and second.count("done at step 30") == 2, second

    _timed(both)
