"""Training throughput with and without checkpointing (issue 3, item 4).

Runs the bench model's training loop for ``--minutes`` with no checkpointing, then for as long
with smartckpt saving every ``--every`` seconds through ``mgr.step()`` (the lazy path), and
reports steps per second of each and their ratio. On a CPU-only machine the background encoding
competes with training for the same cores; on a GPU machine it does not. ``smartckpt bench``
measures the same against torch.save and DCP async_save, in rotated rounds.

    python benchmarks/throughput.py --device cuda --params 4e8 --minutes 3 --every 60 --dir /tmp/tp
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import _common as C
import torch

import smartckpt_cli as sc
from smartckpt_cli.ops.bench_model import DEFAULT_BATCH, build_model, train_step


def _loop(model, opt, seconds: float, batch: int, device: torch.device, mgr=None):
    steps, handles = 0, []
    C.synchronize(device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loss = train_step(model, opt, batch=batch)  # its input is made on the model's device
        steps += 1
        if mgr is not None:
            res = mgr.step(steps, loss=loss)
            if res.handle is not None:
                handles.append(res.handle)
    C.synchronize(device)  # the queued steps belong to this loop's time
    elapsed = time.perf_counter() - t0
    return steps, elapsed, [h.loop_wait_seconds for h in handles]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=1e8)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--every", type=float, default=60.0)
    p.add_argument("--batch", type=int, default=None, help="default: 8 on cpu, 4096 on cuda")
    p.add_argument("--dir", default="/tmp/smartckpt-throughput")
    p.add_argument("--json", default=None)
    C.add_device_argument(p, "where the model trains")
    args = p.parse_args()
    device = C.device_of(args, p)
    batch = args.batch or DEFAULT_BATCH[device.type]

    model, opt = build_model(int(args.params), device=device)
    seconds = args.minutes * 60
    base_steps, base_t, _ = _loop(model, opt, seconds, batch, device)
    shutil.rmtree(args.dir, ignore_errors=True)
    with sc.CheckpointManager(args.dir, every_seconds=args.every, keep_last=2) as mgr:
        mgr.register(model=model, optimizer=opt)
        ck_steps, ck_t, waits = _loop(model, opt, seconds, batch, device, mgr)
        failures = mgr.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "device": device.type,
        "batch": batch,
        "seconds_each": seconds,
        "steps_per_s_without": base_steps / base_t,
        "steps_per_s_with": ck_steps / ck_t,
        "ratio": (ck_steps / ck_t) / (base_steps / base_t),
        "checkpoints": len(waits),
        "loop_wait_s_per_checkpoint": waits,
        "failures": failures,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
