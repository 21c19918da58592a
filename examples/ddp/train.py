"""DDP training under torchrun, checkpointed with smartckpt's API: every rank builds the same
CheckpointManager and calls ``step()``; smartckpt coordinates the ranks (the model and optimizer
state that DDP replicates is written once, each rank's RNG and data position by that rank) and
commits a checkpoint only when every rank's part is durable. Restart it and all ranks resume
from the newest step that every rank can load.

Multi-rank support lives in ``smartckpt_cli.engine.distributed``; this example needs it.

    torchrun --standalone --nproc_per_node 2 examples/ddp/train.py --dir ./checkpoints --steps 200
    smartckpt run --dir ./checkpoints -- torchrun --standalone --nproc_per_node 2 examples/ddp/train.py --steps 200
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import smartckpt_cli as sc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="checkpoint store (default: $SMARTCKPT_DIR or ./checkpoints)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=25, help="also save every N steps")
    args = p.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(1024, 16, generator=g)
    ys = (xs @ torch.randn(16, 1, generator=g)).tanh()
    sampler = DistributedSampler(TensorDataset(xs, ys), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=32, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    mgr = sc.CheckpointManager(args.dir, keep_last=3, every_steps=args.every)  # on every rank
    mgr.register(model=model.module, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()  # all ranks agree on one step
    print(f"rank {rank} starting at step {start}", flush=True)

    step, epoch = start, start // len(loader)  # the sampler epoch a resumed step lies in
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            mgr.step(step, loss=loss)  # every rank, every step
            if step == args.steps:
                break
        epoch += 1
    mgr.save(args.steps, reason="final", blocking=True)
    mgr.close()
    print(f"rank {rank} done at step {args.steps}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
