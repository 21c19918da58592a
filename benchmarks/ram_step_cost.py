"""What the RAM tier costs a training step, at its default cadence.

Two identical models (an MLP of ``--layers`` Linear layers of ``--width``, batch ``--batch``,
AdamW, CPU; about 3 ms a step on 2 idle cores) train in one process, each with its own
``CheckpointManager`` that never saves to disk (``min_interval`` = ``max_interval`` = 10⁹ s):
A without the RAM tier, B with it (the manager made while ``SMARTCKPT_RAM_AREA`` names an area
in ``/dev/shm``, as under ``smartckpt run``; ``ram_every`` unset: as often as 2 % of the step time
allows, at most once a second). Blocks of ``--block-seconds`` alternate A/B, B/A, ... The figure:
time per step B / A − 1 per pair, its median and interquartile range, and the RAM snapshots B
took.

    python benchmarks/ram_step_cost.py --pairs 12 --json ram_step_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import smartckpt_cli as sc  # noqa: E402


def _model(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--block-seconds", type=float, default=3.0)
    p.add_argument("--ram-dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for k in [k for k in os.environ if k.startswith("SMARTCKPT_")]:
        del os.environ[k]
    area = Path(args.ram_dir) / f"smartckpt-ram-step-cost-{os.getpid()}"
    area.mkdir()
    quiet = {"min_interval": 1e9, "max_interval": 1e9}
    try:
        with tempfile.TemporaryDirectory(prefix="smartckpt-ram-step-cost-") as tmp:
            ma, oa = _model(args.width, args.layers)
            mb, ob = _model(args.width, args.layers)
            mgr_a = sc.CheckpointManager(Path(tmp) / "a", **quiet)
            os.environ["SMARTCKPT_RAM_AREA"] = str(area)
            mgr_b = sc.CheckpointManager(Path(tmp) / "b", **quiet)
            del os.environ["SMARTCKPT_RAM_AREA"]
            mgr_a.register(model=ma, optimizer=oa)
            mgr_b.register(model=mb, optimizer=ob)
            x = [torch.randn(args.batch, args.width) for _ in range(16)]
            steps = {"a": 0, "b": 0}

            def block(which: str, n: int) -> float:
                model, opt, mgr = (ma, oa, mgr_a) if which == "a" else (mb, ob, mgr_b)
                t0 = time.perf_counter()
                for _ in range(n):
                    steps[which] += 1
                    loss = model(x[steps[which] % 16]).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    mgr.step(steps[which], loss=loss)
                return (time.perf_counter() - t0) / n

            block("a", 20)
            block("b", 20)
            per = block("a", 50)
            n = max(20, int(args.block_seconds / per))
            pairs = []
            for i in range(args.pairs):
                order = ("a", "b") if i % 2 == 0 else ("b", "a")
                got = {w: block(w, n) for w in order}
                pairs.append(got)
                print(
                    f"pair {i + 1}: without {got['a'] * 1e3:.3f} ms/step, with {got['b'] * 1e3:.3f} ms/step"
                )
            ram = mgr_b._ram
            snaps = ram.snapshots if ram is not None else 0
            cadence = (round(ram.cost, 4), round(ram.interval(), 3)) if ram is not None else (None, None)
            state = sum(it.numel() * it.element_size() for it in [*ma.parameters()]) * 3
            mgr_a.close()
            mgr_b.close()
    finally:
        shutil.rmtree(area, ignore_errors=True)
    over = sorted(pr["b"] / pr["a"] - 1 for pr in pairs)
    q = statistics.quantiles(over, n=4) if len(over) >= 4 else [over[0], statistics.median(over), over[-1]]
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": {"width": args.width, "layers": args.layers, "batch": args.batch, "state_bytes": state},
        "step_ms_without": round(statistics.median(pr["a"] for pr in pairs) * 1e3, 3),
        "step_ms_with": round(statistics.median(pr["b"] for pr in pairs) * 1e3, 3),
        "overhead_median": round(statistics.median(over), 4),
        "overhead_iqr": [round(q[0], 4), round(q[-1], 4)],
        "ram_snapshots": snaps,
        "ram_snapshot_cost_s": cadence[0],  # smoothed: loop wait + copies, hashes, record
        "ram_interval_s": cadence[1],  # the default cadence it settled at
        "steps_with": steps["b"],
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
