"""Why a DDP resume was not bit-exact above two ranks, shown without the rest of smartckpt.

Two experiments under ``python -m torch.distributed.run --nproc_per_node N`` (gloo, CPU), for each
N of ``--ranks``:

1. gloo alone: every rank all-reduces the same 4,096 numbers twice, the second time permuted (as
   another bucket layout places them); the count of sums that differ once put back in order.
2. DDP: an MLP with AdamW and dropout trains 12 steps (``full``), its state (model, optimizer, RNG)
   saved after step 6 with the bucket layout DDP reduces in; a new process group then loads that
   state into a freshly built DDP and trains steps 7-12, as it comes (``resume``) and after
   ``engine/ddp_layout.restore`` gave it the recorded layout (``resume, layout given back``). The
   count of final weights (rank 0's 1,153) that differ from ``full``; the same with
   ``find_unused_parameters=True`` (DDP then never rebuilds its buckets).

    python benchmarks/ddp_sum_order.py [--ranks 2 3 4] [--json benchmarks/results/ddp_sum_order.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def _gloo(out: Path) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    a = x.clone()
    dist.all_reduce(a)
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(99))
    b = x[perm].clone()
    dist.all_reduce(b)
    back = torch.empty_like(b)
    back[perm] = b
    if rank == 0:
        out.write_text(json.dumps({"differ": int((back != a).sum())}))


def _train(mode: str, unused: bool, work: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from smartckpt_cli.engine import ddp_layout

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=unused)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    saved = work / f"step6.r{rank}.pt"
    start = 0
    if mode != "full":
        state = torch.load(saved, weights_only=False)
        ddp.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = 6
        if mode == "relaid":
            ddp_layout.restore(state["meta"], {"model": ("module", ddp)}, dist.get_world_size(), rank, 6)
    data = torch.Generator()
    for step in range(start, 12):
        data.manual_seed(7 + rank * 100_003 + step)
        x = torch.randn(32, 16, generator=data)
        loss = F.mse_loss(ddp(x), x[:, :1].tanh())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mode == "full" and step + 1 == 6:
            meta = ddp_layout.record({"model": ("module", ddp)})
            torch.save(
                {
                    "model": ddp.state_dict(),
                    "optimizer": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                    "meta": meta,
                },
                saved,
            )
    torch.save(ddp.state_dict(), work / f"{mode}.r{rank}.pt")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    work = Path(args.work)
    if args.what == "gloo":
        _gloo(work / "gloo.json")
    else:
        _train(args.what, args.unused, work)
    dist.destroy_process_group()
    return 0


def _launch(n: int, work: Path, *extra: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [*TORCHRUN, str(n), __file__, "--worker", "--work", str(work), *extra]
    for _ in range(3):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
        # On a loaded machine a gloo worker sometimes aborts while its process group is torn down,
        # after its work is written ("terminate called without an active exception"; torch's,
        # not this script's): the run is repeated from scratch, its files overwritten.
        if proc.returncode == 0 or "terminate called without an active exception" not in proc.stderr:
            break
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def _differ(work: Path, mode: str) -> int:
    """Weights of rank 0 (DDP: every rank holds the same) that differ from the full run's."""
    import torch

    a: dict[str, Any] = torch.load(work / "full.r0.pt")
    b: dict[str, Any] = torch.load(work / f"{mode}.r0.pt")
    return sum(int((a[k] != b[k]).sum()) for k in a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="gloo", help=argparse.SUPPRESS)
    ap.add_argument("--unused", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--json",
        default=str(ROOT / "benchmarks" / "results" / "ddp_sum_order.json"),
        help="the result file (default: benchmarks/results/ddp_sum_order.json)",
    )
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    figures: list[tuple[str, int, str]] = []
    if min(args.ranks) < 2:
        ap.error("--ranks of at least 2")
    print("ranks | gloo: sums that differ with the layout (of 4096) | DDP weights (of 1153) differing "
          "after a resume at step 6 of 12: as it comes / layout given back | with find_unused_parameters=True")  # fmt: skip
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            _launch(n, work, "--what", "gloo")
            gloo = json.loads((work / "gloo.json").read_text())["differ"]
            found = {}
            for unused in (False, True):
                flag = ["--unused"] if unused else []
                for mode in ("full", "resume", "relaid"):
                    _launch(n, work, "--what", mode, *flag)
                found[unused] = (_differ(work, "resume"), _differ(work, "relaid"))
        print(
            f"{n} | {gloo} | {found[False][0]} / {found[False][1]} | {found[True][0]} / {found[True][1]}",
            flush=True,
        )
        figures.append(
            (f"gloo_differ_{n}", gloo, f"gloo: sums of 4,096 that differ with another layout, {n} ranks")
        )
        for unused, tag in ((False, ""), (True, "unused_")):
            how = ", find_unused_parameters=True" if unused else ""
            what = f"DDP: final weights of 1,153 differing after a resume as it comes{how}, {n} ranks"
            figures.append((f"{tag}resume_differ_{n}", found[unused][0], what))
            what = f"DDP: the same with the recorded bucket layout given back{how}, {n} ranks"
            figures.append((f"{tag}relaid_differ_{n}", found[unused][1], what))
    # The result file, once every run is done.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _record  # benchmarks/_record.py, beside this script

    rec = _record.start("ddp_sum_order")
    for key, value, what in figures:
        rec.add(key, value, "count", what)
    rec.details["ranks"] = args.ranks
    rec.notes.append("counts do not depend on the machine's speed; gloo on the CPU")
    rec.write(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
