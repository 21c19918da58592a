"""What evaluating the trigger costs a training step (issue 4, must-show 3; target < 1%).

A ~100M-parameter MLP with AdamW (smartckpt_cli.bench.model.build_model) trains on
``--device``. Blocks of ``--block`` steps alternate between a plain loop and the same loop calling
``CheckpointManager.step(step, loss=loss)`` with the default (adaptive) policy; the manager never
saves (``min_interval`` = ``max_interval`` = 10⁹ s: the budget never forces a save and the
policy's own saves are floored away), but its signals and policy run exactly as in training:
the loss is queued on every step, gradient statistics and the planned update are reduced in the
optimizer pre-hook of every evaluation step, which then makes the one host sync, shows the
reading to the policy's ``before_update`` and, at the step boundary before it, captures the RNG
and data states a save before the update would need.

Two figures, both as a share of the plain step time:

* A/B: median over blocks of (time per step with the manager) − (time per step without), the
  blocks interleaved so drift in the machine's speed hits both alike. On a shared machine this
  difference is noisy; its spread (the interquartile range of the per-pair differences) is shown.
* direct: the time spent inside the manager's code itself, measured around ``mgr.step`` and
  around its optimizer pre-hook, summed per block; median over blocks.

    python benchmarks/trigger_cost.py [--device cpu|cuda] [--params 1e8] [--blocks 8] [--block 20] [--eval-every 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import _common as C
import _record
import torch

import smartckpt_cli as sc
from smartckpt_cli.bench.model import build_model
from smartckpt_cli.bench.model import train_step as step_fn  # its input is made on the model's device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=8, help="pairs of blocks (with, without)")
    ap.add_argument("--block", type=int, default=20, help="steps per block (a multiple of eval_every)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    C.add_device_argument(ap, "where the model trains")
    _record.add_json_argument(ap, "trigger_cost")
    args = ap.parse_args()
    device = C.device_of(args, ap)
    rec = _record.start("trigger_cost", device)
    torch.set_num_threads(args.threads)
    model, opt = build_model(int(args.params), device=device)
    n = sum(p.numel() for p in model.parameters())
    inside: list[float] = []  # seconds spent in the manager's code, current block

    with tempfile.TemporaryDirectory(prefix="smartckpt-trigger-cost-") as tmp:
        mgr = sc.CheckpointManager(tmp, min_interval=1e9, max_interval=1e9, eval_every=args.eval_every)
        hook = mgr._before_optimizer_step

        def timed_hook(*a: Any) -> None:
            t = time.perf_counter()
            hook(*a)
            inside.append(time.perf_counter() - t)

        mgr.register(model=model, optimizer=opt)
        # The plain loop must not run the manager's optimizer pre-hook: register()'s is taken off
        # and the same hook, timed, is installed only for the blocks with the manager.
        for h in mgr._hooks:
            h.remove()
        handle = None
        step_no = 0

        def block(with_mgr: bool) -> tuple[float, float]:
            nonlocal step_no, handle
            if with_mgr and handle is None:
                handle = opt.register_step_pre_hook(timed_hook)
            elif not with_mgr and handle is not None:
                handle.remove()
                handle = None
            # the gradient-norm hook on the largest parameter runs only when armed: not in the
            # plain loop; in the manager's loop as step() arms it
            mgr._signals.arm(with_mgr and mgr._signals.due(step_no + 1))
            inside.clear()
            C.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(args.block):
                loss = step_fn(model, opt, args.batch)
                if with_mgr:
                    step_no += 1
                    t = time.perf_counter()
                    res = mgr.step(step_no, loss=loss)
                    inside.append(time.perf_counter() - t)
                    if res.saved:
                        raise RuntimeError("the manager saved; the measurement assumes no saves")
            C.synchronize(device)  # the block's queued work belongs to its time
            return (time.perf_counter() - t0) / args.block, sum(inside) / args.block

        for _ in range(2):  # warm up both paths
            block(True)
            block(False)
        pairs = []
        for i in range(args.blocks):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {w: block(w) for w in order}
            pairs.append((got[True][0], got[False][0], got[True][1]))
            print(
                f"  pair {i + 1}/{args.blocks}: with {got[True][0] * 1e3:.1f} ms/step, "
                f"without {got[False][0] * 1e3:.1f} ms/step, inside the manager {got[True][1] * 1e3:.2f} ms/step",
                flush=True,
            )
        evals = step_no // args.eval_every
        if handle is not None:
            handle.remove()
        mgr.close()
    with_s = [p[0] for p in pairs]
    without_s = [p[1] for p in pairs]
    diff = sorted(p[0] - p[1] for p in pairs)
    direct = [p[2] for p in pairs]
    base = statistics.median(without_s)
    q = statistics.quantiles(diff, n=4) if len(diff) >= 4 else [diff[0], 0, diff[-1]]
    print(
        f"model: {n / 1e6:.1f}M parameters on {device}, AdamW, batch {args.batch}, {args.threads} threads; "
        f"{args.blocks} interleaved pairs of {args.block}-step blocks; eval_every {args.eval_every} "
        f"({evals} evaluations)"
    )
    print(f"step time without the manager (median of blocks): {base * 1e3:.1f} ms")
    print(f"step time with mgr.step       (median of blocks): {statistics.median(with_s) * 1e3:.1f} ms")
    print(
        f"A/B: median per-pair difference {statistics.median(diff) * 1e3:+.2f} ms/step "
        f"= {statistics.median(diff) / base:+.2%} (IQR {q[0] / base:+.2%} .. {q[2] / base:+.2%})"
    )
    print(
        f"direct: time inside mgr.step + its optimizer pre-hook {statistics.median(direct) * 1e3:.2f} ms/step "
        f"= {statistics.median(direct) / base:.2%} of a step (max block {max(direct) / base:.2%})"
    )
    what = f"eval_every {args.eval_every}, no save"
    rec.add("step_ms", base * 1e3, "ms", "step without the manager (median of blocks)")
    rec.add(
        "ab_pct",
        100 * statistics.median(diff) / base,
        "%",
        f"{what}: per-pair difference with / without, median, share of a step",
    )
    rec.add("ab_q1_pct", 100 * q[0] / base, "%", f"{what}: first quartile of the difference")
    rec.add("ab_q3_pct", 100 * q[2] / base, "%", f"{what}: third quartile of the difference")
    rec.add(
        "direct_pct",
        100 * statistics.median(direct) / base,
        "%",
        f"{what}: inside mgr.step and its optimizer pre-hook (the gradient hook not timed), share of a step",
    )
    rec.details.update(params=n, batch=args.batch, threads=args.threads, pairs=pairs, evaluations=evals)
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
