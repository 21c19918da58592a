"""``smartckpt demo``: a training run killed with SIGKILL and resumed, compared bit for bit with
an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


def _child(store: Path, steps: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "smartckpt_cli.ops.demo_train",
        "--dir",
        str(store),
        "--steps",
        str(steps),
        "--save-every",
        "10",
        "--out",
        str(out),
        "--step-time",
        "0.05",
    ]


def run_until(cmd: list[str], kill_at: int | None) -> tuple[list[str], int]:
    """Run a training child; SIGKILL it once it reports step ``kill_at``. Returns (stdout lines, rc)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if kill_at is not None and line.startswith(f"step {kill_at} "):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.stdout.close()
    return lines, proc.wait()


def run_demo(workdir: Path | None, *, steps: int, kill_at: int, say: Callable[[str], None]) -> bool:
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="smartckpt-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    store, ref_store = base / "checkpoints", base / "reference"
    say(f"[bold]1.[/] training {steps} steps, checkpoint every 10 steps, into {store}")
    lines, rc = run_until(_child(store, steps, base / "resumed.pt"), kill_at)
    say(f"   killed with SIGKILL after step {kill_at} (exit status {rc})")
    say("[bold]2.[/] starting the same command again")
    lines, rc = run_until(_child(store, steps, base / "resumed.pt"), None)
    restored = [ln for ln in lines if ln.startswith("restored")]
    say("   " + (restored[0] if restored else "nothing restored"))
    if rc != 0:
        say(f"[red]resumed run failed with exit status {rc}[/]")
        return False
    say("[bold]3.[/] an uninterrupted run of the same script, for comparison")
    run_until(_child(ref_store, steps, base / "reference.pt"), None)
    a = torch.load(base / "resumed.pt", weights_only=True)
    b = torch.load(base / "reference.pt", weights_only=True)
    same_w = all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    same_o = all(
        torch.equal(a["optimizer"]["state"][i][k], b["optimizer"]["state"][i][k])
        for i in b["optimizer"]["state"]
        for k in b["optimizer"]["state"][i]
    )
    say(
        f"   final weights identical: {'yes' if same_w else 'NO'}; optimizer state identical: {'yes' if same_o else 'NO'}"
    )
    say(f"   inspect the store: smartckpt inspect {store}")
    return same_w and same_o
