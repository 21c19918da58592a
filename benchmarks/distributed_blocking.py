"""Blocking time per rank at 2 ranks vs one process, for the same per-rank state (issue 8, item 4).

Each process holds a model of ``--mb`` MiB of float32 parameters with AdamW (so ~3x that of state:
weights and two moments) and takes ``--saves`` checkpoints through ``mgr.step()`` (the lazy path,
as a training loop does). The blocking time of one save is what the loop waited: the ``step()``
call itself (at 2 ranks it includes the per-step decision all_reduce and the eager copies) plus
what the next optimizer step's pre-hook waited for the lazy copies. Each save is let finish before
the next step, so a save never waits for the previous one. Reported: the median per process, and
the ratio of the 2-rank figure (the slower rank) to the single-process one (criterion: <= 1.5x),
and, to separate coordination from contention, the ratio to two independent processes running at
once (``distributed: off``, a store each).

    python benchmarks/distributed_blocking.py [--device cpu|cuda] --mb 64 --saves 9 --dir /tmp/distblock

Runs the single process in this process, then ``python -m torch.distributed.run --nproc_per_node 2``
of itself. On a shared 2-core CPU machine the figures are noisy: run it when the machine is idle.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/X.py` from a checkout without an install runs the checkout; an installed
# smartckpt wins otherwise (a checkout alone lacks the `smartckpt_cli.hooks` package it maps in).
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import _common as C  # noqa: E402
import _record  # noqa: E402

import smartckpt_cli as sc  # noqa: E402


def _training_sync() -> object:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.barrier
    return lambda: None


def measure(
    mb: int, saves: int, directory: Path, distributed: str = "auto", device: str = "cpu"
) -> dict[str, float]:
    torch.set_num_threads(1)
    n = (mb << 20) // 4
    torch.manual_seed(0)
    dev = torch.device(device)
    if dev.type == "cuda":  # one device per local rank, shared round-robin when there are fewer
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n // 4, device=dev)) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = sc.CheckpointManager(
        directory, keep_last=2, every_steps=1, compression_level=-1, distributed=distributed
    )
    mgr.register(model=model, optimizer=opt)
    waits: list[float] = []

    def train_step() -> None:
        for p in model:
            p.grad = torch.full_like(p, 1e-3)
        opt.step()

    train_step()
    sync: Any = _training_sync()
    for step in range(1, saves + 2):
        sync()  # DDP's gradient all-reduce lines the ranks up every step; without it the first
        # collective of smartckpt's step() would absorb the ranks' skew and count it as blocking
        t0 = time.perf_counter()
        res = mgr.step(step)
        call = time.perf_counter() - t0
        train_step()  # the pre-hook waits here for the lazy copies, if they are not done yet
        if res.handle is not None:
            res.handle.wait()
            if step > 1:  # the first save allocates its staging buffers
                waits.append(call + res.handle.loop_wait_seconds - res.handle.blocking_seconds)
    mgr.close()
    state_mb = sum(p.numel() * 4 * 3 for p in model) / (1 << 20)
    return {
        "median_s": statistics.median(waits),
        "max_s": max(waits),
        "state_mb": state_mb,
        "saves": len(waits),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MiB of parameters per process")
    p.add_argument("--saves", type=int, default=9)
    p.add_argument("--dir", default="/tmp/smartckpt-distblock")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # rank mode: JSON out path
    p.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)
    C.add_device_argument(p, "where each process's parameters live")
    _record.add_json_argument(p, "distributed_blocking")
    args = p.parse_args()
    device = C.device_of(args, p).type
    base = Path(args.dir)
    rec = None if args.worker else _record.start("distributed_blocking", device)
    if args.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if args.solo:  # two independent processes at once: the same contention, no coordination
            out = measure(args.mb, args.saves, base / f"solo{dist.get_rank()}", "off", device)
        else:
            out = measure(args.mb, args.saves, base / "ranks", device=device)
        Path(f"{args.worker}.r{dist.get_rank()}").write_text(json.dumps(out))
        dist.destroy_process_group()
        return
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    single = measure(args.mb, args.saves, base / "single", device=device)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    cmd += [
        "--mb",
        str(args.mb),
        "--saves",
        str(args.saves),
        "--dir",
        str(base),
        "--device",
        device,
        "--worker",
        str(base / "out"),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    ranks = [json.loads((base / f"out.r{r}").read_text()) for r in (0, 1)]
    worst = max(r["median_s"] for r in ranks)
    subprocess.run([*cmd[:-1], str(base / "solo"), "--solo"], check=True, env=env, capture_output=True)
    solo = [json.loads((base / f"solo.r{r}").read_text()) for r in (0, 1)]
    solo_worst = max(r["median_s"] for r in solo)
    result = {
        "device": device,
        "state_mb_per_process": round(single["state_mb"], 1),
        "saves": single["saves"],
        "single_median_ms": round(single["median_s"] * 1e3, 2),
        "rank_median_ms": [round(r["median_s"] * 1e3, 2) for r in ranks],
        "ratio": round(worst / single["median_s"], 2),
        "criterion": "<= 1.5",
        # the same two processes at once without coordination: what sharing the machine costs
        "two_independent_median_ms": [round(r["median_s"] * 1e3, 2) for r in solo],
        "ratio_vs_two_independent": round(worst / solo_worst, 2),
    }
    print(json.dumps(result, indent=2))
    shutil.rmtree(base, ignore_errors=True)
    assert rec is not None
    what = "loop wait per save (the step() call and what the next pre-hook waited), median"
    rec.add(
        "state_mb", single["state_mb"] * 1.048576, "MB", "state per process (parameters and AdamW moments)"
    )
    rec.add("single_ms", single["median_s"] * 1e3, "ms", f"one process: {what}")
    rec.add("ranks_ms", worst * 1e3, "ms", f"2 ranks, the slower: {what}")
    rec.add("ratio", worst / single["median_s"], "x", "2 ranks (the slower) / one process")
    rec.add(
        "ratio_vs_two_independent", worst / solo_worst, "x", "2 ranks / two independent processes at once"
    )
    rec.details = result
    rec.write(args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
