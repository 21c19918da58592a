"""A deterministic CPU training loop whose memory climbs until the kernel's OOM killer ends it, for
``tests/test_memory_pressure.py``. Run it inside a memory-limited cgroup.

After building the model and taking one step it prints ``ready`` and waits for one line on stdin
(the parent sets the cgroup's limit meanwhile, from the memory this process uses by then). From
step ``--leak-from`` on, every step keeps a new tensor, sized so the headroom the limit leaves
(read with smartckpt's own memory probe) is gone in about ``--oom-in`` steps. The manager runs a
fixed schedule (``--every``) with the signals evaluated every 5 steps: the memory-pressure save,
not the schedule, should hold the newest state when the kill comes.

Arguments: --dir D, --every K (100), --leak-from N (120; negative: no leak), --oom-in S (120),
--total N (10000), --step-time S (0.008), --no-wait (do not wait for the go line).

Output: ``start S``, ``ready``, ``leak B bytes per step``, ``step N loss HEX`` after each step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from smartckpt_cli import CheckpointManager
from smartckpt_cli.trigger.memory import MemoryProbe


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--leak-from", type=int, default=120)
    p.add_argument("--oom-in", type=int, default=120)
    p.add_argument("--total", type=int, default=10_000)
    p.add_argument("--step-time", type=float, default=0.008)
    p.add_argument("--no-wait", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(3))
    data = torch.Generator()

    def train(step: int) -> torch.Tensor:
        data.manual_seed(1000 + step)  # the batch of a step depends on the step only
        x = torch.randn(16, 32, generator=data)
        loss = F.mse_loss(model(x), (x @ w_true).tanh())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    mgr = CheckpointManager(args.dir, every_steps=args.every, eval_every=5, keep_last=10)
    mgr.register(model=model, optimizer=opt)
    start = mgr.restore()
    print(f"start {start}", flush=True)
    print("ready", flush=True)
    if not args.no_wait:
        sys.stdin.readline()
    probe = MemoryProbe()
    hoard: list[torch.Tensor] = []
    leak = 0
    for step in range(start, args.total):
        if step == args.leak_from:
            sample = probe.read()
            headroom = sample.limit - sample.used if sample is not None else 256 << 20
            leak = max(1 << 20, headroom // max(1, args.oom_in))
            print(f"leak {leak} bytes per step", flush=True)
        if leak:
            hoard.append(torch.ones(leak // 4))  # written: the pages are really in use
        loss = train(step)
        mgr.step(step + 1, loss=loss)
        print(f"step {step + 1} loss {float(loss.detach()).hex()}", flush=True)
        time.sleep(args.step_time)
    mgr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
