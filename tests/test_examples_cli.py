from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_plain_loop_example_runs_and_resumes(tmp_path, child_env):
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "plain_loop.py"),
        "--dir",
        str(tmp_path),
        "--steps",
        "60",
        "--every",
        "20",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "starting at step 0" in first.stdout and "failed saves: 0" in first.stdout
    cmd[cmd.index("60")] = "80"
    second = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "starting at step 60" in second.stdout


@pytest.mark.slow
def test_demo_command_kills_resumes_and_matches(tmp_path, child_env):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "smartckpt_cli.cli.app",
            "demo",
            "--workdir",
            str(tmp_path),
            "--steps",
            "30",
            "--kill-at",
            "17",
        ],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "restored step 10" in out.stdout
    assert "final weights identical: yes; optimizer state identical: yes" in out.stdout


def test_inspect_and_verify_on_a_demo_store(tmp_path, child_env):
    from smartckpt_cli.ops.demo_train import main as train

    assert train(["--dir", str(tmp_path), "--steps", "20", "--save-every", "5"]) == 0
    app = [sys.executable, "-m", "smartckpt_cli.cli.app"]
    ins = subprocess.run(
        [*app, "inspect", str(tmp_path), "--json"], capture_output=True, text=True, env=child_env
    )
    assert ins.returncode == 0, ins.stderr
    import json

    rows = json.loads(ins.stdout)["checkpoints"]
    assert [r["step"] for r in rows if not r["pruned"]] == [20, 15, 10]
    ver = subprocess.run(
        [*app, "verify", str(tmp_path), "--all"], capture_output=True, text=True, env=child_env
    )
    assert ver.returncode == 0 and ver.stdout.count(": ok") == 3, ver.stdout
