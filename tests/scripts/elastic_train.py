"""FSDP2 training that may resume at another world size, for ``tests/test_elastic.py``.

Run under ``python -m torch.distributed.run --nproc_per_node N`` (gloo, CPU), or with ``--single``
as one plain process without torch.distributed (the model unsharded: how a big run is debugged on
one machine). The layer sizes split unevenly over 2 and 3 ranks (34 rows: 17/17, 12/12/10; 5 rows:
3/2, 2/2/1).

Arguments:
  --dir D          checkpoint directory
  --total N        steps to train
  --save-every K   a blocking save every K steps
  --stop-at N      exit 0 right after step N (after its save)
  --dump DIR       rank 0 writes the full (gathered) state: ``saved-<step>.pt`` at every save,
                   ``restored-<step>.pt`` right after a restore
  --samples        print the sample ids of each step: ``ids R STEP a,b,c``
  --width W        hidden width (default 34; another width is another model)
  --layers L       L more W x W layers (benchmarks/elastic_read.py)
  --info           smartckpt's INFO lines (what each rank read when resharding)

The data: 96 samples, ``DistributedSampler(seed=5)``, batch 4 per rank; each sample carries its id.
Output per rank: ``rank R of W start S``, ``rank R done N``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from smartckpt_cli import CheckpointManager


def _full(v: Any) -> Any:
    full = getattr(v, "full_tensor", None)
    return (
        full().detach().clone()
        if callable(full)
        else (v.detach().clone() if isinstance(v, torch.Tensor) else v)
    )


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    """Every tensor gathered whole (a collective on every rank for DTensors)."""
    osd = opt.state_dict()
    return {
        "model": {k: _full(v) for k, v in model.state_dict().items()},
        "optimizer": {pid: {k: _full(v) for k, v in st.items()} for pid, st in osd["state"].items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]],
        "scheduler": sched.state_dict(),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--samples", action="store_true")
    p.add_argument("--single", action="store_true")
    p.add_argument("--width", type=int, default=34, help="hidden width (another model: a mismatch)")
    p.add_argument("--layers", type=int, default=0, help="hidden width x width layers (benchmarks)")
    p.add_argument("--info", action="store_true", help="smartckpt's INFO lines (bytes read per rank)")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights everywhere
    if args.info:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    hidden = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    net = torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.Tanh(), *hidden, torch.nn.Linear(args.width, 5)
    )
    if args.single:
        rank, world, dist = 0, 1, None
        model: torch.nn.Module = net
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 16, generator=g), torch.randn(96, 5, generator=g)
    ds = TensorDataset(x, y, torch.arange(96))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=5)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)

    mgr = CheckpointManager(args.dir)
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()
    print(f"rank {rank} of {world} start {start}", flush=True)
    if args.dump and start:
        st = full_state(model, opt, sched)
        if rank == 0:
            torch.save(st, os.path.join(args.dump, f"restored-{start}.pt"))

    step = start
    while step < args.total:
        for xb, yb, ids in loader:
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if args.samples:
                # one write: the ranks share the terminal, a print's two writes interleave
                os.write(1, f"ids {rank} {step} {','.join(map(str, ids.tolist()))}\n".encode())
            if step % args.save_every == 0:
                mgr.save(step, blocking=True)
                if args.dump:
                    st = full_state(model, opt, sched)
                    if rank == 0:
                        torch.save(st, os.path.join(args.dump, f"saved-{step}.pt"))
            if step == args.stop_at or step >= args.total:
                break
        if step == args.stop_at or step >= args.total:
            break
        sampler.set_epoch(sampler.epoch + 1)
    mgr.close()
    print(f"rank {rank} done {step}", flush=True)
    if dist is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
