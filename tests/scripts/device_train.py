"""A deterministic training script that runs on the CPU or on a CUDA device, for the kill-and-resume
tests of ``tests/test_device_resume.py``.

Determinism on CUDA: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set here before cuBLAS starts, unless
the environment sets it), ``torch.use_deterministic_algorithms(True)`` (an op without a
deterministic kernel raises instead of drifting) and TF32 off for matmuls and cuDNN. Every step
draws from the device's RNG (input noise, dropout), takes a batch from a shuffled DataLoader with a
seeded generator, goes through BatchNorm (running statistics) and changes the learning rate
(OneCycleLR), so a resume that misses any piece of state diverges.

Modes:
  plain        no smartckpt at all (the reference run)
  api          CheckpointManager(--dir, every_steps=--save-every): register, restore, step, close
  zero-code    only ``smartckpt_cli.start_step()``: run it under ``smartckpt run``

Arguments: --device cpu|cuda, --mode, --total N, --dir, --save-every K, --step-time S (seconds of
sleep per step, as a larger model would take), --kill-at N (SIGKILL itself before step N+1, on the
first attempt under ``smartckpt run`` only), --out PATH (the final state, on the CPU).

Output: ``start S``, then ``step N loss HEX`` after each step (float.hex: bit for bit), then
``done N``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before torch runs

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mode", choices=("plain", "api", "zero-code"), default="plain")
    p.add_argument("--total", type=int, default=40)
    p.add_argument("--dir", default=None)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    first_attempt = os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0"

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    device = torch.device(args.device)
    torch.manual_seed(0)  # seeds the CUDA generators too
    g = torch.Generator().manual_seed(1234)
    x_all = torch.randn(256, 16, generator=g)
    y_all = (x_all @ torch.randn(16, 1, generator=g)).tanh()
    loader = DataLoader(
        TensorDataset(x_all, y_all), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(64, 1),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=10_000)

    mgr = None
    start = 0
    if args.mode == "api":
        from smartckpt_cli import CheckpointManager

        mgr = CheckpointManager(args.dir, every_steps=args.save_every)
        mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
        start = mgr.restore()
    elif args.mode == "zero-code":
        import smartckpt_cli

        start = smartckpt_cli.start_step()
    print(f"start {start}", flush=True)
    it = None
    for step in range(start, args.total):
        if step == args.kill_at and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        if it is None:
            it = iter(loader)
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device), y.to(device)
        x = x + 0.1 * torch.randn_like(x)  # the device's RNG
        model.train()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"step {step + 1} loss {float(loss.item()).hex()}", flush=True)
        if mgr is not None:
            mgr.step(step + 1, loss=loss)
    failures = mgr.close() if mgr is not None else []
    print(f"done {args.total}", flush=True)
    if args.out:
        final = {
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "optimizer": _to_cpu(opt.state_dict()),
            "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if device.type == "cuda":
            final["cuda_rng"] = torch.cuda.get_rng_state(device)
        torch.save(final, args.out)
    return 1 if failures else 0


def _to_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
