"""Resource faults not covered elsewhere (disk full and read-only: tests/test_save_failures.py).

* permissions changed between save and restore (a blob or manifest chmod 000), restored in a child
  without CAP_DAC_OVERRIDE (``setpriv``), since root reads through any mode;
* a second writer on the same directory is refused with a clear message, the first one unharmed;
* clocks going backwards: wall-clock time runs backwards during the saves and file mtimes are
  scrambled afterwards; the restore still picks the newest checkpoint by journal order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.errors import StoreLockedError

pytestmark = pytest.mark.usefixtures("isolated")

STEPS = (1, 2, 3)


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _save_steps(path: Path) -> dict[int, list[float]]:
    torch.manual_seed(0)
    model, opt = _build()
    sums = {}
    with CheckpointManager(path, keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in STEPS:
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, blocking=True)
            sums[step] = [float(p.detach().double().sum()) for p in model.parameters()]
    return sums


def _manifest_of(path: Path, step: int) -> tuple[Path, list[Path]]:
    rel = next(p for p in (path / "manifests").iterdir() if p.name.startswith(f"{step:012d}-"))
    man = json.loads(rel.read_bytes())
    blobs = [path / "blobs" / c[0][:2] / c[0] for e in man["entries"].values() for c in e["data"]["chunks"]]
    return rel, blobs


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from smartckpt_cli import CheckpointManager
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(sys.argv[1], keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        step = mgr.restore()
    print(json.dumps({"step": step, "sums": [float(p.detach().double().sum()) for p in model.parameters()]}))
    """
)


def _can_drop_caps() -> bool:
    if shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def _unprivileged_restore(path: Path, child_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", CHILD, str(path)]
    return subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("what", ["blob", "manifest"])
def test_unreadable_newest_checkpoint_falls_back(
    tmp_path: Path, what: str, child_env: dict[str, str]
) -> None:
    if os.geteuid() == 0 and not _can_drop_caps():
        pytest.skip("root reads files of any mode, and setpriv cannot drop CAP_DAC_OVERRIDE here")
    store = tmp_path / "store"
    sums = _save_steps(store)
    manifest, blobs = _manifest_of(store, 3)
    _, older = _manifest_of(store, 2)
    victim = manifest if what == "manifest" else next(b for b in blobs if b not in older)
    victim.chmod(0)
    try:
        if os.geteuid() == 0:
            out = _unprivileged_restore(store, child_env)
        else:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(store)],
                env=child_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        victim.chmod(0o644)
    print(
        f"\nresource fault: {what} chmod 000 -> rc {out.returncode}; {out.stderr.strip().splitlines()[-1:]}"
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 2 and got["sums"] == sums[2]
    assert "step 3" in out.stderr  # the warning names the checkpoint skipped


def test_second_writer_is_refused_and_the_first_keeps_working(tmp_path: Path) -> None:
    store = tmp_path / "store"
    model, opt = _build()
    with CheckpointManager(store, keep_last=10) as first:
        first.register(model=model, optimizer=opt)
        first.save(1, blocking=True)
        with pytest.raises(StoreLockedError) as err:
            CheckpointManager(store, keep_last=10)
        message = str(err.value)
        first.save(2, blocking=True)
    print(f"\nresource fault: second writer -> {message}")
    assert "already being written by pid" in message and str(os.getpid()) in message
    model2, opt2 = _build()
    with CheckpointManager(store, keep_last=10) as again:
        again.register(model=model2, optimizer=opt2)
        assert again.restore() == 2


def test_clocks_going_backwards_never_reorder_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    start = time.time()
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "time", lambda: start - 3600.0 * next(ticks))  # each reading an hour earlier
    sums = _save_steps(store)
    monkeypatch.undo()
    now = time.time()
    for step in STEPS:  # the newest files look oldest: mtimes a day apart, backwards
        manifest, blobs = _manifest_of(store, step)
        for path in [manifest, *blobs]:
            os.utime(path, (now - 86400 * step, now - 86400 * step))
    (store / "manifests" / "x").touch()  # and something with a future mtime
    os.utime(store / "manifests" / "x", (now + 10**6, now + 10**6))
    (store / "manifests" / "x").unlink()
    model, opt = _build()
    with CheckpointManager(store, keep_last=10) as mgr:
        mgr.register(model=model, optimizer=opt)
        step = mgr.restore()
    print(f"\nresource fault: clock backwards and mtimes scrambled -> restored step {step}")
    assert step == 3
    assert [float(p.detach().double().sum()) for p in model.parameters()] == sums[3]
