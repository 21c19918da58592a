"""A deterministic multi-rank CPU training script (gloo) with an explicit CheckpointManager, for
``tests/test_distributed.py``. Run it under ``python -m torch.distributed.run --nproc_per_node N`` (2, 3, 4).

Arguments:
  --mode ddp|fsdp     DistributedDataParallel, or FSDP2 (``fully_shard``: DTensor shards)
  --total N           steps to train (default 30)
  --dir D             checkpoint directory; with --node-local each rank uses D/node<rank>
  --meta-dir M        shared journal directory (default: D)
  --every K           save every K steps (default 5)
  --out PREFIX        at the end each rank writes PREFIX.r<rank> (torch.save of its local state)
  --kill-at N --kill-rank R   rank R SIGKILLs itself before step N+1 (first attempt only)
  --kill-after-remote  with --kill-at: the killing rank first waits (up to 120 s) until the remote
                      in SMARTCKPT_REMOTE holds a commit, so a slow machine cannot kill the group
                      before any upload finished
  --hang-at N --hang-rank R   rank R sleeps forever before step N+1 (first attempt only)
  --signal-at N --signal-rank R --signal NAME   rank R sends itself SIGNAME before step N+1
                      (first attempt only): a preemption warning that reaches one rank
  --stop-at N         every rank exits 0 after step N (after waiting for its save)
  --step-time S       extra seconds per step (default 0)
  --zero-code         no CheckpointManager: the loop starts at smartckpt_cli.start_step() and the
                      hooks of ``smartckpt run`` checkpoint every rank
  --bucket-cap-kb K   DDP's bucket_cap_mb as K KiB (small: several gradient buckets)
  --comm-hook         register DDP's allreduce communication hook on the reducer
  --register-inner    register the module the script built (``net``), not its DDP wrapper, as most
                      scripts do
  --loader            the data from a DataLoader with a DistributedSampler and no generator of its
                      own, iterated by epochs (``for epoch ...: for x, y in loader``) from the
                      epoch and batch of the start step, its iterator made after the restore

Output per rank: ``rank R start S``, ``rank R step N loss HEX``, ``rank R done N``. The
``--dir``/``--every`` flags are optional under ``smartckpt run`` (its environment sets them).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from torch.utils.data import DistributedSampler

from smartckpt_cli import CheckpointManager


def _local(v: object) -> object:
    to_local = getattr(v, "to_local", None)
    return to_local() if callable(to_local) else v


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--total", type=int, default=30)
    p.add_argument("--dir", default=None)
    p.add_argument("--meta-dir", default=None)
    p.add_argument("--node-local", action="store_true")
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-after-remote", action="store_true")
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--signal", default="TERM")
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--zero-code", action="store_true")
    p.add_argument("--bucket-cap-kb", type=float, default=None)
    p.add_argument("--comm-hook", action="store_true")
    p.add_argument("--register-inner", action="store_true")
    p.add_argument("--loader", action="store_true")
    args = p.parse_args()
    first_attempt = os.environ.get(proto.ENV_ATTEMPT, "0") == "0"

    torch.set_num_threads(1)  # bit-exact CPU reductions run to run
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
    )
    model: torch.nn.Module
    if args.mode == "ddp":
        cap = {} if args.bucket_cap_kb is None else {"bucket_cap_mb": args.bucket_cap_kb / 1024}
        model = torch.nn.parallel.DistributedDataParallel(net, **cap)
        if args.comm_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    torch.manual_seed(100 + rank)  # rank-local RNG (dropout): each rank's own state is saved

    settings = {}
    if args.dir is not None:
        settings["directory"] = os.path.join(args.dir, f"node{rank}") if args.node_local else args.dir
    if args.meta_dir is not None:
        settings["meta_dir"] = args.meta_dir
    if args.every is not None:
        settings["every_steps"] = args.every
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(3))
    loader = None
    if args.loader:
        xs = torch.randn(512, 16, generator=torch.Generator().manual_seed(11))
        ds = torch.utils.data.TensorDataset(xs, (xs @ w_true).tanh())
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=True))
    mgr: CheckpointManager | None = None
    if args.zero_code:
        import smartckpt_cli

        start = smartckpt_cli.start_step()
    else:
        mgr = CheckpointManager(**settings)
        mgr.register(model=net if args.register_inner else model, optimizer=opt, scheduler=sched)
        if loader is not None:
            mgr.register(data=loader)
        start = mgr.restore()
    print(f"rank {rank} start {start}", flush=True)
    for step, x, y in _batches(args, start, rank, w_true, loader):
        if first_attempt and args.kill_at == step and args.kill_rank == rank:
            if args.kill_after_remote:
                _wait_for_a_remote_commit(120.0)
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and args.signal_at == step and args.signal_rank == rank:
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
        if first_attempt and args.hang_at == step and args.hang_rank == rank:
            while True:
                time.sleep(60)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if mgr is not None:
            mgr.step(step + 1, loss=loss)
        print(f"rank {rank} step {step + 1} loss {float(loss.detach()).hex()}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        if args.stop_at == step + 1:
            if mgr is not None:
                mgr.close()
            dist.destroy_process_group()
            return 0
    failures = mgr.close() if mgr is not None else []
    if args.out:
        torch.save(
            {
                "model": {k: _local(v).clone() for k, v in model.state_dict().items()},
                "optimizer": {
                    "state": {
                        i: {k: _local(v).clone() for k, v in s.items()}
                        for i, s in opt.state_dict()["state"].items()
                    },
                    "param_groups": opt.state_dict()["param_groups"],
                },
                "scheduler": sched.state_dict(),
                "rng": torch.get_rng_state(),
            },
            f"{args.out}.r{rank}",
        )
    print(f"rank {rank} done {args.total} failures {len(failures)}", flush=True)
    dist.destroy_process_group()
    return 0


def _wait_for_a_remote_commit(timeout: float) -> None:
    """Poll the remote journal until it holds a live commit (the other ranks wait at the next
    collective meanwhile; their background uploads go on)."""
    from smartckpt_cli.remote.replica import open_remote, replica_journal

    journal = replica_journal(open_remote(os.environ["SMARTCKPT_REMOTE"]))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not journal.read().live():
        time.sleep(0.2)


def _batches(args: argparse.Namespace, start: int, rank: int, w_true: torch.Tensor, loader: object):
    """(step, x, y) from ``start`` to ``--total``: the batch of a step made from (rank, step), so
    a resumed run sees the same data; or, with ``--loader``, the loader's, epoch by epoch."""
    if loader is None:
        data = torch.Generator()
        for step in range(start, args.total):
            data.manual_seed(7 + rank * 100_003 + step)
            x = torch.randn(32, 16, generator=data)
            yield step, x, (x @ w_true).tanh()
        return
    per_epoch = len(loader)  # type: ignore[arg-type]
    step = start
    for epoch in range(start // per_epoch, args.total // per_epoch + 1):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in loader:  # type: ignore[attr-defined]
            if step >= args.total:
                return
            yield step, x, y
            step += 1


if __name__ == "__main__":
    raise SystemExit(main())
