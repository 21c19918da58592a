"""The remote tier at 1 and 2 ranks (issue 22): bytes each rank sends, its upload lag at a save
every ``--every-s`` seconds, and the time to restore from the remote onto empty disks.

For each world size in ``--ranks`` (torchrun, gloo, CPU; 1 = one plain process), an MLP of about
``--params`` parameters with AdamW trains for ``--seconds`` seconds under DDP (``--mode ddp``:
replicated state, sent once per store) or FSDP2 (``--mode fsdp``: each rank its shard), with
``dir`` node-local per rank, ``meta_dir`` shared and ``remote`` set. Each rank reports:

- bytes it sent to the remote (blobs, part manifests, markers), and blobs it skipped as already
  remote (another rank's or an earlier step's);
- its upload lag while training (``lag_seconds`` of its status file, sampled every step: the age of
  the oldest checkpoint whose part is not up yet), mean and max, and what ``close()`` waited;
- restore: the local dirs and ``meta_dir`` deleted, the same job restarted restores from the
  remote (seconds in ``restore()``, bytes downloaded per rank).

    python benchmarks/remote_ranks.py [--ranks 1 2] [--mode ddp|fsdp] [--params 5e6]
                                      [--seconds 20] [--every-s 4] [--moto] [--json out.json]

``--moto`` runs against moto's S3 server (started here, throwaway credentials); the default is a
``file://`` directory. Figures on a shared 2-core machine are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


# ---------------------------------------------------------------- the child (one rank)


def child(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from smartckpt_cli import CheckpointManager
    from smartckpt_cli.remote.parts import status_name

    torch.set_num_threads(1)
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if multi:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if multi else 0
    world = dist.get_world_size() if multi else 1
    torch.manual_seed(0)
    width = max(64, int((args.params / 3) ** 0.5))
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    )  # fmt: skip
    model: torch.nn.Module = net
    if multi and args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif multi:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    work = Path(args.work)
    mgr = CheckpointManager(
        work / "local" / f"node{rank}",
        meta_dir=work / "shared",
        every_seconds=args.every_s,
        keep_last=3,
        remote=args.remote,
    )
    mgr.register(model=model, optimizer=opt)
    t0 = time.perf_counter()
    start = mgr.restore()
    restore_s = time.perf_counter() - t0
    out: dict[str, Any] = {"rank": rank, "world": world, "start": start, "restore_s": round(restore_s, 3)}
    if args.restore_only:
        mgr.close()
        mine = work / "local" / f"node{rank}"
        out["downloaded"] = sum(
            f.stat().st_size for d in ("blobs", "manifests") for f in (mine / d).rglob("*") if f.is_file()
        )
    else:
        status = work / "shared" / status_name(rank)
        lags: list[float] = []
        x = torch.randn(64, width)
        step, deadline = start, time.monotonic() + args.seconds
        while True:
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            mgr.step(step, loss=loss)
            try:  # the status is a snapshot: the lag it names has grown since it was written
                st = json.loads(status.read_text())
                pending = st.get("part_pending", st.get("pending", 0))
                age = time.time() - float(st.get("updated") or time.time())
                lags.append(float(st.get("lag_seconds") or 0.0) + age if pending else 0.0)
            except (OSError, ValueError):
                pass
            go = torch.tensor([int(time.monotonic() < deadline)])
            if multi:  # the same number of steps on every rank
                dist.all_reduce(go, op=dist.ReduceOp.MIN)
            if not go.item():
                break
        t1 = time.perf_counter()
        mgr.close()
        st = json.loads(status.read_text())
        out.update(
            steps=step,
            parts=st.get("parts_sent", 0) if multi else st.get("checkpoints_sent", 0),
            bytes_sent=st.get("bytes_sent", 0),
            blobs_sent=st.get("blobs_sent", 0),
            blobs_deduped=st.get("blobs_deduped", 0),
            lag_mean_s=round(sum(lags) / len(lags), 3) if lags else 0.0,
            lag_max_s=round(max(lags), 3) if lags else 0.0,
            close_wait_s=round(time.perf_counter() - t1, 3),
        )
    print("RESULT " + json.dumps(out), flush=True)
    if multi:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "bench-key",
        "AWS_SECRET_ACCESS_KEY": "bench-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for _ in range(300):
        try:
            urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=2).read()
            return proc, env
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("moto server did not come up")


def run(
    nproc: int, work: Path, remote: str, args: argparse.Namespace, env: dict[str, str], *extra: str
) -> list[dict]:
    me = [str(Path(__file__).resolve()), "--child", "--work", str(work), "--remote", remote]
    me += ["--mode", args.mode, "--params", str(args.params), "--seconds", str(args.seconds)]
    me += ["--every-s", str(args.every_s), *extra]
    cmd = [sys.executable, *me] if nproc == 1 else [*TORCHRUN, str(nproc), *me]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(m) for m in re.findall(r"^RESULT (.*)$", proc.stdout, re.M)]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--restore-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--remote", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--params", type=float, default=5e6)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--every-s", type=float, default=4.0)
    p.add_argument("--moto", action="store_true")
    p.add_argument(
        "--json", default=None, help="the result file (default: benchmarks/results/remote_ranks.json)"
    )
    args = p.parse_args()
    if args.child:
        return child(args)
    import _record

    args.json = args.json or str(_record.RESULTS / "remote_ranks.json")
    rec = _record.start("remote_ranks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    moto = None
    if args.moto:
        moto, aws = start_moto()
        env.update(aws)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="smartckpt-remote-ranks-") as tmp:
            for n in args.ranks:
                work = Path(tmp) / f"w{n}"
                if args.moto:
                    import boto3

                    bucket = f"bench-{n}"
                    boto3.client(
                        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                    ).create_bucket(Bucket=bucket)  # fmt: skip
                    remote = f"s3://{bucket}/job"
                else:
                    remote = args.remote or f"file://{Path(tmp) / f'remote{n}'}"
                train = run(n, work, remote, args, env)
                shutil.rmtree(work / "local")  # every node's disk
                shutil.rmtree(work / "shared")  # and the shared meta_dir
                restore = run(n, work, remote, args, env, "--restore-only")
                results.append({"ranks": n, "train": train, "restore": restore})
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
    where = "moto S3" if args.moto else (args.remote or "file://")
    print(
        f"remote tier, {args.mode}, ~{args.params / 1e6:.1f}M params, save every {args.every_s:g} s, {where}"
    )
    print(f"{'ranks':>5} {'rank':>4} {'steps':>5} {'sent MB':>8} {'blobs':>6} {'dedup':>6} "
          f"{'MB/part':>7} {'lag mean s':>10} {'lag max s':>9} {'close s':>7} {'restore s':>9} {'fetched MB':>10} {'from step':>9}")  # fmt: skip
    for res in results:
        for tr, rs in zip(res["train"], res["restore"], strict=True):
            print(
                f"{res['ranks']:>5} {tr['rank']:>4} {tr['steps']:>5} {tr['bytes_sent'] / 1e6:>8.1f} "
                f"{tr['blobs_sent']:>6} {tr['blobs_deduped']:>6} "
                f"{tr['bytes_sent'] / 1e6 / max(1, tr['parts']):>7.1f} {tr['lag_mean_s']:>10.2f} "
                f"{tr['lag_max_s']:>9.2f} {tr['close_wait_s']:>7.2f} {rs['restore_s']:>9.2f} "
                f"{rs['downloaded'] / 1e6:>10.1f} {rs['start']:>9}"
            )
    for res in results:
        n = res["ranks"]
        for tr, rs in zip(res["train"], res["restore"], strict=True):
            key, who = f"r{n}.rank{tr['rank']}", f"{n} rank(s), rank {tr['rank']}"
            rec.add(f"{key}.sent_mb", tr["bytes_sent"] / 1e6, "MB", f"{who}: bytes sent to the remote")
            rec.add(f"{key}.parts", tr["parts"], "count", f"{who}: checkpoints (parts) sent")
            rec.add(
                f"{key}.per_part_mb",
                tr["bytes_sent"] / 1e6 / max(1, tr["parts"]),
                "MB",
                f"{who}: sent per checkpoint",
            )
            rec.add(f"{key}.blobs_sent", tr["blobs_sent"], "count", f"{who}: blobs sent")
            rec.add(
                f"{key}.blobs_found",
                tr["blobs_deduped"],
                "count",
                f"{who}: blobs found on the remote already",
            )
            rec.add(
                f"{key}.lag_mean_s", tr["lag_mean_s"], "s", f"{who}: upload lag sampled at each step, mean"
            )
            rec.add(f"{key}.lag_max_s", tr["lag_max_s"], "s", f"{who}: upload lag, largest")
            rec.add(f"{key}.close_s", tr["close_wait_s"], "s", f"{who}: what close() waited for the uploads")
            rec.add(
                f"{key}.restore_s", rs["restore_s"], "s", f"{who}: restore onto empty disks, from the remote"
            )
            rec.add(
                f"{key}.fetched_mb", rs["downloaded"] / 1e6, "MB", f"{who}: bytes downloaded by the restore"
            )
    rec.details.update(
        mode=args.mode,
        params=args.params,
        seconds=args.seconds,
        every_s=args.every_s,
        remote=where,
        results=results,
    )
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
