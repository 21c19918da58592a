"""The control plane never imports torch: operators' commands answer at once, and the supervisor
beside every job stays small. Proven with an importable ``torch`` that raises on import placed
first on the path, and with the supervisor's memory map."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import smartckpt_cli as sc

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A real store with two checkpoints and a signal trace (written with torch, of course)."""
    d = tmp_path_factory.mktemp("store")
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    with sc.CheckpointManager(d, eval_every=1, max_interval=3600) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 21):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.step(step, loss=loss)
            if step % 10 == 0:
                mgr.save(step, blocking=True)
    return d


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    poison = tmp_path_factory.mktemp("poison")
    (poison / "torch").mkdir()
    (poison / "torch" / "__init__.py").write_text('raise ImportError("the control plane imported torch")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(poison), str(ROOT)])
    return env


def _smartckpt(
    args: list[str], env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_poison_works(no_torch_env):
    res = subprocess.run(
        [sys.executable, "-c", "import torch"], env=no_torch_env, capture_output=True, text=True
    )
    assert res.returncode != 0 and "the control plane imported torch" in res.stderr


def test_importing_the_package_does_not_import_torch(no_torch_env):
    code = "import smartckpt_cli, sys; print(smartckpt_cli.__version__, 'torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=no_torch_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [sc.__version__, "False"]


def test_the_lazy_names_still_resolve():
    assert sc.CheckpointManager.__name__ == "CheckpointManager"
    assert callable(sc.start_step) and callable(sc.seed_score)
    assert {"CheckpointManager", "start_step", "SaveHandle", "StepResult"} <= set(dir(sc))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = sc.nope  # type: ignore[attr-defined]


def test_operators_commands_run_without_torch(store, no_torch_env, tmp_path):
    trace = next((store / "traces").glob("*.csv"))
    commands = [
        ["--help"],
        ["inspect", str(store)],
        ["ls", str(store), "--json"],
        ["inspect", str(store), "--step", "10"],
        ["verify", str(store)],
        ["verify", str(store), "--all"],
        ["config", "show"],
        ["completions", "bash"],
        ["simulate", str(trace), "--json"],
        ["simulate", str(trace), "--plot", str(tmp_path / "policies.png")],
        ["plot", str(store), "-o", str(tmp_path / "run.png")],
        ["plot", str(store), "--json", "--x", "step"],
        ["prune", str(store), "--keep", "2", "--dry-run"],
        ["rollback", str(store), "--to-prev"],
        ["rollback", str(store), "--undo"],
    ]
    for args in commands:
        res = _smartckpt(args, no_torch_env, cwd=tmp_path)
        assert res.returncode == 0, f"smartckpt {' '.join(args)}: {res.stdout[-500:]}{res.stderr[-2000:]}"


def test_commands_that_need_tensors_say_so_in_one_line_without_torch(store, no_torch_env, tmp_path):
    res = _smartckpt(["export", str(store), str(tmp_path / "out.pt")], no_torch_env)
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "torch" in lines[0], lines


def test_the_supervisor_maps_no_libtorch(tmp_path, no_torch_env):
    """``smartckpt run`` watches its child without loading torch (the child may, of course)."""
    script = tmp_path / "child.py"
    script.write_text("import time\nprint('child up', flush=True)\ntime.sleep(30)\n")
    env = dict(no_torch_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", str(tmp_path / "ck"), str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            if "child up" in line or time.monotonic() > deadline:
                break
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert proc.poll() is None
        assert "libtorch" not in maps
        rss_kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1])
        assert rss_kb < 150_000, f"supervisor resident {rss_kb} kB"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
