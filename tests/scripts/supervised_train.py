"""A deterministic CPU training script with an explicit CheckpointManager, for the supervisor's
end-to-end tests (``tests/test_supervisor.py``).

Under ``smartckpt run`` the manager takes its directory and schedule from the environment the
supervisor sets (``SMARTCKPT_DIR``, ``SMARTCKPT_EVERY_STEPS``). The script beats the run
protocol's heartbeat itself at each step unless the injected hooks already do, so the
supervisor sees steps and losses either way.

Arguments:
  --total N          steps to train (default 40)
  --out PATH         at the end, torch.save {"model", "optimizer", "scheduler", "rng"} to PATH
  --step-time S      extra seconds of sleep per step (default 0.02)
  --fail-at N        raise RuntimeError before step N+1 (N=0: before the first step)
  --hang-at N        sleep forever before step N+1
  --kill-at N        SIGKILL itself before step N+1
  --fault-attempts A attempts (SMARTCKPT_ATTEMPT) on which the faults fire: "0" (default) or "all"

Output: ``start S``, then ``step N loss HEX`` after each step, then ``done N``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from torch.utils.data import DataLoader, TensorDataset

from smartckpt_cli import CheckpointManager


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--fault-attempts", default="0")
    args = p.parse_args(argv)
    attempt = os.environ.get(proto.ENV_ATTEMPT, "0")
    faults = args.fault_attempts == "all" or attempt in args.fault_attempts.split(",")

    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x_all = torch.randn(256, 16, generator=g)
    y_all = (x_all @ torch.randn(16, 1, generator=g)).tanh()
    loader = DataLoader(
        TensorDataset(x_all, y_all), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=10_000)

    mgr = CheckpointManager()  # directory, schedule: SMARTCKPT_* from the supervisor
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()
    run_dir = os.environ.get(proto.ENV_RUN_DIR)
    beat = None
    if run_dir and not os.path.exists(proto.heartbeat_path(run_dir, os.getpid())):
        beat = proto.HeartbeatWriter(run_dir)
        beat.beat(step=start, state=proto.TRAINING)
    print(f"start {start}", flush=True)
    if "SMARTCKPT_MTBF" in os.environ:
        print(f"env SMARTCKPT_MTBF={os.environ['SMARTCKPT_MTBF']}", flush=True)
    it = iter(loader)
    for step in range(start, args.total):
        if faults and step == args.fail_at:
            raise RuntimeError(f"injected failure at step {step}")
        if faults and step == args.hang_at:
            print(f"hanging at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if faults and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x = x + 0.1 * torch.randn_like(x)
        model.train()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        print(f"step {step + 1} loss {float(loss.item()).hex()}", flush=True)
        mgr.step(step + 1, loss=loss)
        if beat is not None:
            done = mgr.last_commit.step if mgr.last_commit is not None else None
            beat.beat(step=step + 1, loss=float(loss.item()), committed_step=done)
    failures = mgr.close()
    print(f"done {args.total}", flush=True)
    if args.out:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng": torch.get_rng_state(),
            },
            args.out,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
