"""A small deterministic CPU training run: AdamW, an LR scheduler, dropout and a shuffled
DataLoader, checkpointed with CheckpointManager. ``smartckpt demo`` and the resume tests run it,
kill it with SIGKILL and run it again.

Each step prints ``step N loss HEX`` (float.hex, so traces compare bit for bit); the final state is
written with torch.save to ``--out`` for comparison with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from smartckpt_cli import CheckpointManager


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, DataLoader[Any]]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(480, 32, generator=g)
    y = (x @ torch.randn(32, 1, generator=g)).tanh() + 0.05 * torch.randn(480, 1, generator=g)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed + 1)
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.BatchNorm1d(128),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=10_000)
    return model, opt, sched, loader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--precision", default="exact")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds per step, as a real model would take"
    )
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    random.seed(0)
    np.random.seed(0)
    model, opt, sched, loader = build()
    mgr = CheckpointManager(args.dir, precision=args.precision, every_steps=args.save_every)
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()
    if start:
        data = mgr.registered("data")
        print(
            f"restored step {start}: model ({len(model.state_dict())} tensors), AdamW moments, "
            f"OneCycleLR (lr {sched.get_last_lr()[0]:.3e}), RNG, data position "
            f"(epoch {data.epochs}, batch {data.batches})",
            flush=True,
        )
    it = iter(loader)
    for step in range(start, args.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        model.train()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"step {step + 1} loss {float(loss.item()).hex()}", flush=True)
        mgr.step(step + 1, loss=loss)
    failures = mgr.close()
    if args.out:
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
            args.out,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
