"""Is this tree slower than an earlier commit? Save, restore and step, side by side.

Two versions of the package cannot live in one process, so each round runs the same workload
in two fresh processes, one importing the earlier commit (checked out into a temporary git
worktree) and one importing this tree, in alternating order; a figure is the median over the
rounds, and the comparison is this tree's median over the earlier one's (1.00: the same; above:
slower). Separate processes on this 2-core machine differ by ±20 %: the rounds alternate so that
load drifts hit both sides alike.

The workload (``--worker``): the bench MLP of ``--params`` parameters with AdamW trains
``--steps`` steps on the CPU under a ``CheckpointManager`` saving every ``--every`` steps through
``mgr.step`` (the lazy path a loop takes), each save waited for before the next; then a fresh
model and optimizer restore the newest checkpoint. Per round and side:

* step: the median step time without a save in flight (the loop's clock; torch's forward,
  backward and update dominate it, and their noise), and ``mgr.step()``'s own time on those
  steps (smartckpt's part of a step);
* save, loop wait: ``SaveHandle.loop_wait_seconds`` (what the loop waited for the copy), median;
* save, until committed: from the save's step to ``SaveHandle.wait()`` returning, median;
* restore: ``CheckpointManager.restore()`` of the newest checkpoint, into live objects.

    python benchmarks/against_commit.py --commit 0f51640 [--rounds 4] [--params 2.5e7] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The driver uses this tree's package; a worker the one on its PYTHONPATH (the side it measures).
if "--worker" not in sys.argv and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIGURES = {
    "step_ms": "median step without a save in flight (torch's compute dominates it)",
    "step_call_ms": "mgr.step() itself on a step without a save, median (smartckpt's part of a step)",
    "save_wait_ms": "save: the loop's wait (SaveHandle.loop_wait_seconds), median",
    "save_commit_ms": "save: from its step until committed, median",
    "restore_ms": "restore() of the newest checkpoint into live objects",
}


def worker(params: int, steps: int, every: int) -> dict[str, float | str]:
    """One side of a round, in a process whose ``smartckpt_cli`` is the side's version."""
    import torch

    import smartckpt_cli as sc

    torch.set_num_threads(1)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        width = min(4096, max(64, int((params / 4) ** 0.5)))
        layers = max(1, round(params / (width * width + width)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, opt = build()
    x = torch.randn(8, next(model.parameters()).shape[1])
    plain: list[float] = []
    calls: list[float] = []
    waits: list[float] = []
    commits: list[float] = []
    with tempfile.TemporaryDirectory(prefix="smartckpt-against-") as tmp:
        mgr = sc.CheckpointManager(tmp, every_steps=every, keep_last=2)
        mgr.register(model=model, optimizer=opt)
        mgr.restore()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            res = mgr.step(step)
            t2 = time.perf_counter()
            dt = t2 - t0
            if res.saved and res.handle is not None:
                res.handle.wait()
                commits.append(time.perf_counter() - t0)
                waits.append(res.handle.loop_wait_seconds)
            elif step > 1:
                plain.append(dt)
                calls.append(t2 - t1)
        mgr.close()
        model2, opt2 = build()
        mgr2 = sc.CheckpointManager(tmp)
        mgr2.register(model=model2, optimizer=opt2)
        t0 = time.perf_counter()
        start = mgr2.restore()
        restore = time.perf_counter() - t0
        mgr2.close()
        if start != (steps // every) * every:
            raise SystemExit(f"restored step {start}, expected {(steps // every) * every}")
    return {
        "step_ms": 1e3 * statistics.median(plain),
        "step_call_ms": 1e3 * statistics.median(calls),
        "save_wait_ms": 1e3 * statistics.median(waits),
        "save_commit_ms": 1e3 * statistics.median(commits),
        "restore_ms": 1e3 * restore,
        "package": str(Path(sc.__file__).parent),
    }


def _side(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """One side of a round: the workload in a fresh process importing ``root``'s package."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    cmd += ["--params", str(args.params), "--steps", str(args.steps), "--every", str(args.every)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the workload failed under {root}: {out.stderr.strip()[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got.pop("package").startswith(str(root)):  # the side measured the other side's code
        raise SystemExit(f"the workload under {root} did not import {root}'s smartckpt_cli")
    return got


def main() -> int:
    import _record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", help="the earlier commit to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--params", type=float, default=2.5e7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _record.add_json_argument(ap, "against_commit")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.params), args.steps, args.every)))
        return 0
    if not args.commit or args.rounds < 1 or args.steps < 2 * args.every:
        ap.error("--commit is needed, --rounds at least 1, --steps at least two saves' worth")
    import torch  # noqa: F401  (imported for the record's torch version: the sides run it)

    rec = _record.start("against_commit")
    with tempfile.TemporaryDirectory(prefix="smartckpt-against-tree-") as tmp:
        old = Path(tmp) / "old"
        add = ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.commit]
        if subprocess.run(add, capture_output=True, text=True, check=False).returncode != 0:
            raise SystemExit(f"cannot check out {args.commit!r} (is it a commit of this repository?)")
        try:
            sides: dict[str, list[dict[str, float]]] = {"earlier": [], "this": []}
            for r in range(args.rounds):
                order = [("earlier", old), ("this", ROOT)]
                for name, root in order if r % 2 == 0 else order[::-1]:
                    sides[name].append(_side(root.resolve(), args))
                    print(f"round {r + 1} {name}: {sides[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    for key, what in FIGURES.items():
        before = statistics.median(s[key] for s in sides["earlier"])
        after = statistics.median(s[key] for s in sides["this"])
        rec.add(f"{key}[earlier]", before, "ms", f"{what}, commit {args.commit}")
        rec.add(f"{key}[this]", after, "ms", f"{what}, this tree")
        rec.add(f"{key}[ratio]", after / before, "x", f"{what}: this tree over commit {args.commit}")
        print(
            f"{key:16} {args.commit}: {before:9.3f} ms   this tree: {after:9.3f} ms   ratio {after / before:.2f}"
        )
    rec.details.update(
        rounds=args.rounds, params=int(args.params), steps=args.steps, every=args.every, sides=sides
    )
    rec.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
