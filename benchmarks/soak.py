"""200 consecutive saves (issue 3, item 5): resident memory, file descriptors and threads after
the warm-up against the end, with the staging copy's size for scale.

    python benchmarks/soak.py [--device cuda] --params 2.5e7 --saves 200 --dir /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading

import _common as C
import _record
import psutil

import smartckpt_cli as sc
from smartckpt_cli.bench.model import build_model, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--params", type=float, default=2.5e7)
    p.add_argument("--saves", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dir", default="/tmp/smartckpt-soak")
    C.add_device_argument(p, "where the model trains")
    _record.add_json_argument(p, "soak")
    args = p.parse_args()
    device = C.device_of(args, p)
    rec = _record.start("soak", device)
    shutil.rmtree(args.dir, ignore_errors=True)
    model, opt = build_model(int(args.params), device=device)
    proc = psutil.Process()
    with sc.CheckpointManager(args.dir, keep_last=2, every_steps=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, args.saves + 1):
            train_step(model, opt, batch=2)
            res = mgr.step(step)
            assert res.saved, step
            if step == args.warmup:
                mgr.wait()
                before = (proc.memory_info().rss, proc.num_fds(), threading.active_count())
        mgr.wait()
        after = (proc.memory_info().rss, proc.num_fds(), threading.active_count())
        staging = mgr._stager.nbytes
        failures = mgr.failures
    shutil.rmtree(args.dir, ignore_errors=True)
    out = {
        "device": device.type,
        "saves": args.saves,
        "staging_bytes": staging,
        "rss_growth_bytes": after[0] - before[0],
        "rss_growth_over_staging": (after[0] - before[0]) / staging,
        "fds": [before[1], after[1]],
        "threads": [before[2], after[2]],
        "failures": len(failures),
    }
    print(json.dumps(out, indent=2))
    after_warmup = f"between save {args.warmup} and save {args.saves}"
    rec.add("saves", args.saves, "count", "consecutive saves, one per step")
    rec.add("staging_mb", staging / 1e6, "MB", "one staging copy of the state")
    rec.add("rss_growth_mb", (after[0] - before[0]) / 1e6, "MB", f"resident memory growth {after_warmup}")
    rec.add("rss_growth_over_staging", (after[0] - before[0]) / staging, "x", "the same, in staging copies")
    rec.add("fds_before", before[1], "count", f"open file descriptors after save {args.warmup}")
    rec.add("fds_after", after[1], "count", f"open file descriptors after save {args.saves}")
    rec.add("threads_before", before[2], "count", f"threads after save {args.warmup}")
    rec.add("threads_after", after[2], "count", f"threads after save {args.saves}")
    rec.add("failures", len(failures), "count", "failed saves")
    rec.details = out
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
