"""What the remote tier costs the training loop, and what it buys after a lost disk.

Trains an MLP with AdamW (on ``--device``) for ``--steps`` steps, saving every ``--every`` steps, twice:
without a remote, and with ``--remote`` (default: a ``file://`` directory in the work dir; pass
an ``s3://`` URL with the usual AWS_* variables for object storage). Reports per variant:

- step time (median and p90 over all steps, saves included);
- loop wait per save (what ``StepResult.handle.loop_wait_seconds`` says the loop waited);
- upload lag at the end of the loop (committed checkpoints not yet remote), the time ``close()``
  then waited for the uploads, bytes sent and blobs skipped as already remote;
- restore after wipe: the local store deleted, a new manager restores from the remote (time,
  step restored).

    python benchmarks/remote_tier.py [--device cpu|cuda] [--params 5e6] [--steps 60] [--every 10]
                                     [--remote s3://bucket/prefix | --moto] [--bandwidth-mb 0] [--json out.json]

``--moto`` starts moto's S3 server here (throwaway credentials) and replicates to it.

Figures on a shared 2-core machine are noisy; compare the two variants of one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/X.py` from a checkout without an install runs the checkout; an installed
# smartckpt wins otherwise (a checkout alone lacks the `smartckpt_cli.hooks` package it maps in).
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import _common as C  # noqa: E402
import _record  # noqa: E402
import torch  # noqa: E402

from smartckpt_cli import CheckpointManager  # noqa: E402
from smartckpt_cli.remote.check import STATUS_FILE  # noqa: E402


def build(params: float, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    torch.manual_seed(0)
    width = max(64, int((params / 3) ** 0.5))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ).to(device)  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), width


def one_variant(work: Path, args: argparse.Namespace, remote: str | None) -> dict[str, Any]:
    model, opt, width = build(args.params, args.dev)
    store = work / ("with-remote" if remote else "local-only")
    extra: dict[str, Any] = {"remote": remote, "remote_bandwidth_mb": args.bandwidth_mb} if remote else {}
    mgr = CheckpointManager(store, every_steps=args.every, keep_last=3, **extra)
    mgr.register(model=model, optimizer=opt)
    x = torch.randn(32, width, device=args.dev)
    step_times, waits = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        res = mgr.step(step)
        C.synchronize(args.dev)  # a step's time includes its queued device work
        step_times.append(time.perf_counter() - t0)
        if res.handle is not None:
            res.handle.wait()
            waits.append(res.handle.loop_wait_seconds)
    status = json.loads((store / STATUS_FILE).read_text()) if remote else {}
    t0 = time.perf_counter()
    mgr.close()
    close_s = time.perf_counter() - t0
    q = statistics.quantiles(step_times, n=10)
    out: dict[str, Any] = {
        "variant": "remote" if remote else "local only",
        "params": sum(p.numel() for p in model.parameters()),
        "step_median_ms": round(statistics.median(step_times) * 1e3, 2),
        "step_p90_ms": round(q[-1] * 1e3, 2),
        "loop_wait_per_save_ms": round(statistics.mean(waits) * 1e3, 2) if waits else None,
        "saves": len(waits),
        "lag_at_loop_end": status.get("pending"),
        "close_wait_s": round(close_s, 2),
    }
    if remote:
        final = json.loads((store / STATUS_FILE).read_text())
        out["bytes_sent"] = final["bytes_sent"]
        out["blobs_deduped"] = final["blobs_deduped"]
        shutil.rmtree(store)
        model2, opt2, _ = build(args.params, args.dev)
        t0 = time.perf_counter()
        with CheckpointManager(store, remote=remote) as m2:
            m2.register(model=model2, optimizer=opt2)
            out["restored_step"] = m2.restore()
            out["restore_after_wipe_s"] = round(time.perf_counter() - t0, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=5e6)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--remote", default=None, help="default: file:// in the work dir")
    p.add_argument("--moto", action="store_true", help="an S3 remote on moto's server, started here")
    p.add_argument("--bandwidth-mb", type=float, default=0.0, help="remote_bandwidth_mb (0: unlimited)")
    p.add_argument("--workdir", type=Path, default=None)
    C.add_device_argument(p, "where the model trains")
    _record.add_json_argument(p, "remote_tier")
    args = p.parse_args()
    args.dev = C.device_of(args, p)
    if args.moto and args.remote:
        p.error("--moto and --remote: one remote at a time")
    rec = _record.start("remote_tier", args.dev)
    work = Path(tempfile.mkdtemp(prefix="smartckpt-remote-bench-", dir=args.workdir))
    moto = None
    saved_env = dict(os.environ)
    try:
        remote = args.remote or f"file://{work / 'remote'}"
        if args.moto:
            from remote_ranks import start_moto

            moto, aws = start_moto()
            os.environ.update(aws)
            import boto3

            boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(
                Bucket="bench"
            )
            remote = "s3://bench/job"
        rows = [one_variant(work, args, None), one_variant(work, args, remote)]
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(work, ignore_errors=True)
    keys = list(rows[1])
    for k in keys:
        print(f"{k:24s} " + "  ".join(f"{r.get(k, '-')!s:>14}" for r in rows))
    where = "moto S3" if args.moto else "file://" if remote.startswith("file://") else remote.split("/")[0]
    for r in rows:
        key = "remote" if r["variant"] == "remote" else "local"
        what = f"{'with the remote (' + where + ')' if key == 'remote' else 'without a remote'}"
        rec.add(
            f"{key}.step_median_ms", r["step_median_ms"], "ms", f"{what}: step time, median (saves included)"
        )
        rec.add(f"{key}.step_p90_ms", r["step_p90_ms"], "ms", f"{what}: step time, 90th percentile")
        if r["loop_wait_per_save_ms"] is not None:
            rec.add(
                f"{key}.loop_wait_ms",
                r["loop_wait_per_save_ms"],
                "ms",
                f"{what}: loop wait per save (library's counter), mean",
            )
        rec.add(f"{key}.close_s", r["close_wait_s"], "s", f"{what}: what close() waited")
    r = rows[1]
    rec.add(
        "remote.lag_at_end",
        r["lag_at_loop_end"] or 0,
        "count",
        "checkpoints not yet remote when the loop ended",
    )
    rec.add("remote.sent_mb", r["bytes_sent"] / 1e6, "MB", "bytes sent to the remote")
    rec.add("remote.blobs_found", r["blobs_deduped"], "count", "blobs found on the remote already")
    rec.add("remote.restore_s", r["restore_after_wipe_s"], "s", "restore after the local store was deleted")
    rec.add("remote.restored_step", r["restored_step"], "steps", "the step it restored")
    rec.details.update(
        variants=rows,
        remote=where,
        bandwidth_mb=args.bandwidth_mb,
        params=args.params,
        steps=args.steps,
        every=args.every,
    )
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
