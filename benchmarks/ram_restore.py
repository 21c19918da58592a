"""A restore from the RAM tier: one thread against the rank's share of the cores, in one process.

A child process trains the bench MLP (``--params``, AdamW) a few steps with the RAM tier on
(``SMARTCKPT_RAM_AREA`` set as ``smartckpt run`` sets it) and exits without closing, as a crash
would; its snapshot stays in the tmpfs. This process then restores it ``--rounds`` times with the
engine's own ``RamTier.load`` (every chunk verified and copied into fresh tensors, as a restarted
process does), alternating 1 thread and ``RamTier.workers`` threads, and checks that both give the
same tensors. The copy into fresh memory is what a restore costs (its page faults); the threads
share it.

    python benchmarks/ram_restore.py --params 100000000 --rounds 7 --json ram_restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, sys, time
import torch
torch.set_num_threads(1)
import smartckpt_cli as sc
from smartckpt_cli.bench.model import build_model, train_step
model, opt = build_model(int(sys.argv[1]))
mgr = sc.CheckpointManager(sys.argv[2], max_interval=1e9, min_interval=1e9, ram_every=0.01)
mgr.register(model=model, optimizer=opt)
for step in range(1, 4):
    mgr.step(step, train_step(model, opt))
    time.sleep(0.5)
mgr.wait()
while mgr._ram is None or mgr._ram.last is None:
    time.sleep(0.1)
os._exit(0)
"""


def write_snapshot(params: int, tmp: Path, area: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(PYTHONPATH=str(ROOT), SMARTCKPT_RAM_AREA=str(area))
    script = tmp / "child.py"
    script.write_text(CHILD)
    subprocess.run(
        [sys.executable, str(script), str(params), str(tmp / "store")], env=env, check=True, timeout=600
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=100_000_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ram-dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    from smartckpt_cli.config import Settings
    from smartckpt_cli.engine.ramtier import RamTier
    from smartckpt_cli.store import ramarea

    tmp = Path(tempfile.mkdtemp(prefix="ram-restore-"))
    area = Path(args.ram_dir) / f"smartckpt-ram-restore-{os.getpid()}"
    area.mkdir()
    try:
        write_snapshot(args.params, tmp, area)
        rank = area / "rank0"
        rec = ramarea.read_record(rank)
        assert rec is not None, "the child left no RAM snapshot"
        tier = RamTier(rank, 1 << 40, Settings(), rec["store_id"], 0, 1)
        many = tier.workers
        times: dict[str, list[float]] = {"1 thread": [], f"{many} threads": []}
        for i in range(args.rounds):
            order = [1, many] if i % 2 == 0 else [many, 1]
            for workers in order:
                tier.workers = workers
                t0 = time.perf_counter()
                loaded = tier.load(rec)
                times["1 thread" if workers == 1 else f"{many} threads"].append(time.perf_counter() - t0)
                assert loaded is not None
                del loaded
        tier.workers = 1
        one = tier.load(rec)
        tier.workers = many
        other = tier.load(rec)
        assert one is not None and other is not None
        assert all(torch.equal(one.tensors[k], other.tensors[k]) for k in one.tensors)
        state = sum(int(e["nbytes"]) for e in rec["entries"].values())
    finally:
        shutil.rmtree(area, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "command": "python " + " ".join(sys.argv),
        "params": args.params,
        "state_bytes": state,
        "cpus": os.cpu_count(),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "ratio_one_over_many": round(med["1 thread"] / med[f"{many} threads"], 2) if many > 1 else 1.0,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
