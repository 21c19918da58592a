"""What the resume check costs the training thread, against what a save already costs it.

The check takes the loss and the gradient norm of one step: the step after each save (the
expected values) and the first step after a restore (the values compared). On the training
thread that is one ``_foreach_norm`` over the first optimizer's gradients, a sum, and (CUDA) an
asynchronous copy to a pinned buffer with an event; the read-back, the comparison and the journal
line run on the manager's save thread. Steps that follow neither a save nor a restore take
nothing but an integer comparison.

An MLP (``--layers`` Linear layers of ``--width``, AdamW) trains on ``--device``. Per round, in
an order that rotates every round (so drift in the machine's speed hits all alike):

* **step**: one training step (forward, backward, ``opt.step``) without smartckpt;
* **check**: the check's training-thread part at that step
  (``capture(step, loss, None, grad_sumsq(opt))``, what ``mgr.step`` does at an armed step);
* **save**: the blocking part of a save of that state by the same ``CheckpointManager``
  (``save(...).blocking_seconds``: the snapshot copy; the previous save is committed first).

Figures: the medians, and check / save and check / step, with their interquartile ranges over
the rounds. The save thread's part (``expect_job``: read back, one journal line with fsync) is
timed on its own, off the training thread.

    python benchmarks/resume_check_cost.py          # benchmarks/results/resume_check_cost.json
    python benchmarks/resume_check_cost.py --width 2048 --json benchmarks/results/resume_check_cost-2048.json
    python benchmarks/resume_check_cost.py --device cuda --width 4096 --json resume_check_cost-gpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/resume_check_cost.py` from a checkout
    sys.path.insert(0, str(ROOT))

import _record  # noqa: E402  (benchmarks/ is the script's own folder)
import torch  # noqa: E402

from smartckpt_cli.engine.manager import CheckpointManager  # noqa: E402
from smartckpt_cli.engine.resumecheck import capture, expect_job, grad_sumsq  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    _record.add_json_argument(p, "resume_check_cost")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width)] + (
            [torch.nn.ReLU()] if i < args.layers - 1 else []
        )
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=device)
    params = sum(t.numel() for t in model.parameters())

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    times: dict[str, list[float]] = {"step": [], "check": [], "save": [], "save_thread": []}
    with tempfile.TemporaryDirectory() as tmp:
        mgr = CheckpointManager(Path(tmp) / "store", min_interval=1e9, max_interval=1e9, keep_last=2)
        mgr.register(model=model, optimizer=opt)
        loss = train_step()  # moments exist; warm up every path once
        mgr.save(0).wait()
        capture(1, loss, None, grad_sumsq(opt)).read()
        parts = ["step", "check", "save"]
        for r in range(args.rounds):
            for part in parts[r % 3 :] + parts[: r % 3]:
                _sync(device)
                t0 = time.perf_counter()
                if part == "step":
                    loss = train_step()
                elif part == "check":
                    values = capture(r + 1, loss, None, grad_sumsq(opt))
                else:
                    handle = mgr.save(r + 1)
                _sync(device)
                if part == "save":
                    times["save"].append(handle.blocking_seconds)
                    info = handle.wait()
                    assert info is not None
                else:
                    times[part].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            expect_job(values, handle, mgr.store.journal.append)  # the save thread's part
            times["save_thread"].append(time.perf_counter() - t0)
        mgr.close()
    ratio = {
        "check/save": [c / s for c, s in zip(times["check"], times["save"], strict=True)],
        "check/step": [c / s for c, s in zip(times["check"], times["step"], strict=True)],
    }
    out = {
        "device": str(device),
        "params": params,
        "rounds": args.rounds,
        "median_seconds": {k: statistics.median(v) for k, v in times.items()},
        "ratios": {k: _quartiles(v) for k, v in ratio.items()},
    }
    med = out["median_seconds"]
    print(f"{params / 1e6:.1f}M parameters on {device}, {args.rounds} rounds (median):")
    print(f"  training step            {med['step'] * 1e3:9.3f} ms")
    print(f"  resume check (training)  {med['check'] * 1e3:9.3f} ms   once after each save and each restore")
    print(f"  save, blocking part      {med['save'] * 1e3:9.3f} ms")
    print(f"  resume check (save thread) {med['save_thread'] * 1e3:7.3f} ms   off the training thread")
    for k, (lo, m, hi) in out["ratios"].items():
        print(f"  {k:12s} {m:8.4f}  (IQR {lo:.4f}..{hi:.4f})")
    rec = _record.start("resume_check_cost", device)
    what = f"median over {args.rounds} rounds"
    rec.add("step_ms", med["step"] * 1e3, "ms", f"one training step without smartckpt, {what}")
    rec.add("check_ms", med["check"] * 1e3, "ms", f"the resume check's training-thread part, {what}")
    rec.add("save_ms", med["save"] * 1e3, "ms", f"the blocking part of a save of the same state, {what}")
    rec.add("save_thread_ms", med["save_thread"] * 1e3, "ms", f"the check's save-thread part, {what}")
    for key, name in (("check/save", "check_over_save"), ("check/step", "check_over_step")):
        lo, m, hi = out["ratios"][key]
        rec.add(f"{name}_pct", 100 * m, "%", f"{key}, per round, median")
        rec.add(f"{name}_q1_pct", 100 * lo, "%", f"{key}, first quartile")
        rec.add(f"{name}_q3_pct", 100 * hi, "%", f"{key}, third quartile")
    rec.details.update(out)
    rec.details["model_description"] = (
        f"MLP {args.layers}x{args.width} ({params / 1e6:.1f}M parameters), batch {args.batch}, AdamW"
    )
    rec.write(args.json)
    print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
