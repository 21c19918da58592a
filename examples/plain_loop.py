"""A plain PyTorch training loop checkpointed with smartckpt's API.

Run it, interrupt it (Ctrl-C, ``kill -9``, a crash), run it again: it continues from the newest
verified checkpoint, with the model, optimizer, scheduler, RNG and data position restored.

    python examples/plain_loop.py --dir ./checkpoints --steps 200
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="checkpoints")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=25, help="save every N steps (the 180 s budget applies too)")
    args = p.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 20), torch.randint(0, 4, (1024,)))
    # A seeded generator makes the shuffling replayable, so a resume continues at the exact batch.
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    mgr = sc.CheckpointManager(args.dir, keep_last=3, every_steps=args.every)
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()  # 0 on a first run
    print(f"starting at step {start}")

    it = iter(loader)
    for step in range(start, args.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        mgr.step(step + 1, loss=loss)  # saves in the background when due
    mgr.save(args.steps, reason="final", blocking=True)
    failures = mgr.close()
    print(f"done at step {args.steps}, loss {loss.item():.4f}, failed saves: {len(failures)}")


if __name__ == "__main__":
    main()
