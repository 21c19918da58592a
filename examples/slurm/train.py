"""A small, deterministic CPU training run for the SLURM example (``train.sbatch``).

It checkpoints through an explicit ``CheckpointManager``; the store directory comes from
``--dir``, else from ``SMARTCKPT_DIR`` (which ``smartckpt run --dir`` sets), else
``./checkpoints``. A preemption signal (SIGUSR1 from ``#SBATCH --signal=B:USR1@90``, or SIGTERM)
makes the manager take a blocking checkpoint at the next step and exit through the signal;
the next run (the requeued job) continues from that checkpoint, and its final weights are
bitwise identical to an uninterrupted run's.

    python examples/slurm/train.py --dir ./checkpoints --steps 400

Output: ``start step=S restart=N`` once, ``step=K loss=...`` for every step, and
``final weights sha256=HEX`` at the end (tests compare that line across runs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F

import smartckpt_cli as sc


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="checkpoint store (default: $SMARTCKPT_DIR or ./checkpoints)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50, help="also save every N steps")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step, to stand in for real work")
    args = p.parse_args()

    # Deterministic on the CPU: one thread (SLURM may give the job fewer cores than a direct run
    # has), fixed seeds; dropout draws from the RNG that the checkpoint restores.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(512, 16, generator=gen)
    ys = (xs @ torch.randn(16, 1, generator=gen)).tanh() + 0.05 * torch.randn(512, 1, generator=gen)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    mgr = sc.CheckpointManager(args.dir, keep_last=3, every_steps=args.every)
    mgr.register(model=model, optimizer=opt, scheduler=sched)
    start = mgr.restore()  # 0 on the first run; the preemption checkpoint's step after a requeue
    print(f"start step={start} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}", flush=True)

    batch = 32
    for step in range(start, args.steps):
        i = (step * batch) % len(xs)  # the batch is a function of the step: nothing else to resume
        x, y = xs[i : i + batch], ys[i : i + batch]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        print(f"step={step + 1} loss={loss.item():.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        mgr.step(step + 1, loss=loss)  # saves when due; on SIGUSR1/SIGTERM saves, then exits
    mgr.save(args.steps, reason="final", blocking=True)
    mgr.close()
    print(f"final weights sha256={weights_sha256(model)}", flush=True)


if __name__ == "__main__":
    main()
