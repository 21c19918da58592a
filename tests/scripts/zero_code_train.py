"""A plain deterministic CPU training script with no smartckpt code but one line: the loop starts at
``smartckpt_cli.start_step()``. Run under ``smartckpt run`` (or directly with the environment the
supervisor sets: hooks directory on PYTHONPATH, SMARTCKPT_RUN_DIR, SMARTCKPT_DIR, ...), the
injected hooks find the model, AdamW, the LR scheduler and the DataLoader, checkpoint them and
restore them; the final weights then equal an uninterrupted run's bit for bit.

Every step draws from the global torch RNG (input noise, dropout), takes a batch from a shuffled
DataLoader with a seeded generator, and changes the learning rate (OneCycleLR), so a resume that
misses any piece of state diverges.

Arguments:
  --total N          steps to train (default 40)
  --out PATH         at the end, torch.save {"model", "optimizer", "scheduler", "rng"} (and
                     "scaler" with --amp) to PATH
  --step-time S      extra seconds of sleep per step, as a real model would take (default 0)
  --amp              a GradScaler (CPU) whose scale changes every 3 steps; steps 4, 12 and 19
                     overflow on purpose, so the scaler skips their optimizer step
  --fp8              the model also keeps fp8 training state: a float8_e4m3fn amax history and a
                     float8_e5m2 scale, updated every step and fed back into the input, so a
                     resume that loses or rounds them diverges
  --jolt-at N        the optimizer step of loop index N (printed as step N+1) runs at 400x the
                     learning rate: a loss spike whose cause the planned update shows in advance
  --fail-at N        raise RuntimeError("injected failure at step N") before step N+1 (N=0: before
                     the first step)
  --hang-at N        sleep forever before step N+1 (for hang detection)
  --kill-at N        SIGKILL itself before step N+1
  --exit-at N        exit with --exit-code (default 3) before step N+1
  --fault-attempts A the attempts (SMARTCKPT_ATTEMPT, 0 when unset) on which the faults above fire:
                     a comma-separated list such as "0" (default: only the first start) or "all"

Output (stdout, flushed line by line):
  ``start S``                  once, S = the step the loop starts from (start_step())
  ``step N loss HEX``          after each step N (1-based), the loss as float.hex (bit-exact)
  ``done N``                   after the loop, N = --total
Exit status 0 when the loop finished.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli

OVERFLOW_STEPS = {4, 12, 19}  # with --amp: the scaler skips these optimizer steps


def _faults_armed(spec: str) -> bool:
    attempt = os.environ.get("SMARTCKPT_ATTEMPT", "0")
    return spec.strip() == "all" or attempt in {a.strip() for a in spec.split(",")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--jolt-at", type=int, default=None)
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--exit-at", type=int, default=None)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--fault-attempts", default="0")
    args = p.parse_args(argv)
    faults = _faults_armed(args.fault_attempts)

    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    torch.manual_seed(0)
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
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=10_000)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if args.amp else None
    if args.fp8:
        model.register_buffer("amax_history", torch.zeros(8).to(torch.float8_e4m3fn))
        model.register_buffer("scale", torch.ones(1).to(torch.float8_e5m2))

    start = smartckpt_cli.start_step(total=args.total)
    print(f"start {start}", flush=True)
    it = None
    for step in range(start, args.total):
        if faults and step == args.fail_at:
            raise RuntimeError(f"injected failure at step {step}")
        if faults and step == args.hang_at:
            print(f"hanging at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if faults and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if faults and step == args.exit_at:
            return args.exit_code
        if it is None:
            it = iter(loader)
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x = x + 0.1 * torch.randn_like(x)  # the global torch RNG
        if args.fp8:
            with torch.no_grad():  # as fp8 recipes do: amax history -> scale -> the next input
                hist = model.amax_history.float().roll(1)
                hist[0] = x.abs().max()
                model.amax_history.copy_(hist.to(torch.float8_e4m3fn))
                model.scale.copy_((4.0 / hist.max()).reshape(1).to(torch.float8_e5m2))
            x = x * model.scale.float()
        model.train()
        loss = F.mse_loss(model(x), y)
        if scaler is not None:
            overflow = 1e38 if step + 1 in OVERFLOW_STEPS else 1.0
            scaler.scale(loss * overflow).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if step == args.jolt_at:  # set from the schedule, as a loop that sets its lr would
                for g, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
                    g["lr"] = 400.0 * lr
            opt.step()
            for g, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
                g["lr"] = lr
        sched.step()
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"step {step + 1} loss {float(loss.item()).hex()}", flush=True)
    print(f"done {args.total}", flush=True)
    if args.out:
        final = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if scaler is not None:
            final["scaler"] = scaler.state_dict()
        torch.save(final, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
