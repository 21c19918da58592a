"""A custom ``accelerate`` loop as its documentation writes it: ``Accelerator.prepare`` on the model,
optimizer, DataLoader and scheduler, ``accumulate`` for gradient accumulation, ``backward``. Runs
in one process or under torchrun (gloo on CPU). No smartckpt code but ``start_step()`` (zero-code
under ``smartckpt run``), or with ``--api`` a CheckpointManager given what ``prepare`` returned,
as the README shows.

The DataLoader shuffles with no generator of its own and the model has dropout, so a resume that
misses the data position, the global RNG or the loader's draws diverges.

Arguments: --total N (optimizer steps, default 24), --grad-accum K (default 2), --kill-at S
--kill-rank R (rank R SIGKILLs itself after optimizer step S, first attempt only), --out PREFIX
(each rank writes PREFIX.r<rank>: torch.save of its model and optimizer state), --api.
Output per rank: ``rank R start S``, ``rank R step N loss HEX``, ``rank R done``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--total", type=int, default=24)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--api", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    acc = Accelerator(gradient_accumulation_steps=a.grad_accum, cpu=True)
    set_seed(0)
    rank = acc.process_index
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(192, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh()
    dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    mgr = None
    if a.api:
        mgr = sc.CheckpointManager()  # directory and schedule from smartckpt run's environment
        mgr.register(model=model, optimizer=opt, scheduler=sched, data=dl)
        start = mgr.restore()
    else:
        start = sc.start_step()
    print(f"rank {rank} start {start}", flush=True)
    per_epoch = len(dl) // a.grad_accum
    step = start
    attempt = os.environ.get("SMARTCKPT_ATTEMPT", "0")
    for _epoch in range(start // per_epoch, a.total // per_epoch + 1):
        for xb, yb in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not acc.sync_gradients:
                continue
            step += 1
            print(f"rank {rank} step {step} loss {float(loss.detach()).hex()}", flush=True)
            if mgr is not None:
                mgr.step(step, loss=loss)
            if step == a.kill_at and rank == a.kill_rank and attempt == "0":
                time.sleep(1.5)  # the save taken a few steps ago commits in the background meanwhile
                os.kill(os.getpid(), signal.SIGKILL)
            if step == a.total:
                break
        if step == a.total:
            break
    if mgr is not None:
        mgr.close()
    if a.out:
        unwrapped = acc.unwrap_model(model)
        torch.save({"model": unwrapped.state_dict(), "optimizer": opt.state_dict()}, f"{a.out}.r{rank}")
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
