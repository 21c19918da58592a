"""Host memory of the RAM tier per rank, against the state's size.

Two fresh processes train the bench MLP (``--params``, AdamW) for ``--steps`` steps with a
``CheckpointManager`` that saves to disk once (step 5) and then only by its budget: one without
the RAM tier, one with it (``SMARTCKPT_RAM_AREA`` set as ``smartckpt run`` sets it, RAM
snapshots every ``--ram-every`` s). Each reports, at the end: the state's size (every tensor of
the model and optimizer state), its process memory (``psutil``: RSS, USS = memory only it holds,
and the shared part), the RAM area's files in the tmpfs, and how many RAM snapshots it took.

    python benchmarks/ram_memory.py --params 25000000 --json ram_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import psutil, torch
torch.set_num_threads(1)
import smartckpt_cli as sc
from smartckpt_cli.bench.model import build_model, state_tensors, train_step
params, steps, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model, opt = build_model(params)
state = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
mgr = sc.CheckpointManager(store, max_interval=1e9, min_interval=1e9, ram_every=float(sys.argv[4]))
mgr.register(model=model, optimizer=opt)
for step in range(1, steps + 1):
    loss = train_step(model, opt)
    if step == 5:
        mgr.save(step, blocking=True)
    mgr.step(step, loss)
mgr.wait()
m = psutil.Process().memory_full_info()
area = os.environ.get("SMARTCKPT_RAM_AREA")
files = sum(f.stat().st_size for f in Path(area).rglob("*") if f.is_file()) if area else 0
ram = mgr._ram
print(json.dumps({"state_bytes": state, "rss": m.rss, "uss": m.uss, "shared": m.shared,
                  "ram_area_bytes": files, "ram_snapshots": ram.snapshots if ram else 0}))
mgr.close()
""".replace("import psutil, torch", "import psutil, torch\nfrom pathlib import Path")


def run(args: argparse.Namespace, tmp: Path, ram: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = str(ROOT)
    area = Path(args.ram_dir) / f"smartckpt-ram-memory-{os.getpid()}"
    if ram:
        area.mkdir()
        env["SMARTCKPT_RAM_AREA"] = str(area)
    script = tmp / "child.py"
    script.write_text(CHILD)
    store = tmp / ("store-ram" if ram else "store")
    try:
        out = subprocess.run(
            [sys.executable, str(script), str(args.params), str(args.steps), str(store), str(args.ram_every)],
            env=env, capture_output=True, text=True, check=True, timeout=900,
        )  # fmt: skip
    finally:
        shutil.rmtree(area, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=25_000_000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ram-every", type=float, default=0.5)
    p.add_argument("--ram-dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="smartckpt-ram-memory-") as tmp:
        off = run(args, Path(tmp), False)
        on = run(args, Path(tmp), True)
    gib = 2**30
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "off": off,
        "on": on,
        "state_gib": round(off["state_bytes"] / gib, 3),
        "ram_area_over_state": round(on["ram_area_bytes"] / on["state_bytes"], 3),
        "rss_delta_over_state": round((on["rss"] - off["rss"]) / on["state_bytes"], 3),
        "uss_delta_over_state": round((on["uss"] - off["uss"]) / on["state_bytes"], 3),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
