"""A plain PyTorch loop with no smartckpt code but one line, checkpointed by ``smartckpt run``.

``smartckpt run`` injects hooks that find the model, optimizer, LR scheduler and DataLoader, and
checkpoint them when its trigger says so; ``smartckpt_cli.start_step()`` restores the newest
verified checkpoint into them and returns its step (0 on a first run, and 0 outside
``smartckpt run``, where the script runs as plain PyTorch). Kill it (``kill -9``), and the
supervisor restarts it from there.

    smartckpt run --dir ./checkpoints -- python examples/zero_code.py --steps 300
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
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

    start = smartckpt_cli.start_step()  # the only smartckpt line
    print(f"starting at step {start}", flush=True)
    it = iter(loader)
    for _step in range(start, args.steps):
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
    print(f"done at step {args.steps}, loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
