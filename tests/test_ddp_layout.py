"""engine/ddp_layout.py: DDP's gradient bucket layout recorded at a save and given back at a
restore. One real DDP in a one-rank gloo world (a child process, so this process never holds a
process group); the multi-rank resumes are in tests/test_many_ranks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from smartckpt_cli.engine.ddp_layout import parse_layout
from tests.conftest import ROOT

CHILD = r"""
import json, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from smartckpt_cli.engine import ddp_layout

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.manual_seed(0)

def make(**kw):
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.25 / 1024, **kw)

def train(ddp, steps):
    for _ in range(steps):
        x = torch.randn(8, 16)
        F.mse_loss(ddp(x), x[:, :1]).backward()

def buckets(ddp):
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]

out = {}
ddp = make()
objects = {"model": ("module", ddp)}
out["fresh"] = ddp_layout.record(objects)
out["initial"] = buckets(ddp)
train(ddp, 2)
out["step2"] = ddp_layout.record(objects)  # rebuilt, but DDP's logging data does not show it yet
train(ddp, 1)
out["step3"] = ddp_layout.record(objects)
out["rebuilt"] = buckets(ddp)
meta = out["step3"]

again = make()  # a resumed job's DDP: built in the initial layout
out["limits"] = ddp_layout.restore(meta, {"model": ("module", again)}, 3, 0, 9)
out["restored"] = buckets(again)
out["remembered"] = ddp_layout.record({"model": ("module", again)})
train(again, 3)  # the new reducer rebuilds once, to the same layout
out["after"] = buckets(again)

class Wrapper:  # zero-code mode registers a wrapper with .module
    def __init__(self, m):
        self.module = m

hooked = make()
hooked.register_comm_hook(None, default_hooks.allreduce_hook)
out["hooked"] = ddp_layout.restore(meta, {"model": ("module", Wrapper(hooked))}, 3, 0, 9)
out["hooked_two_ranks"] = ddp_layout.restore(meta, {"model": ("module", make())}, 2, 0, 9)
out["old_checkpoint"] = ddp_layout.restore(None, {"model": ("module", make())}, 4, 0, 9)
out["early_checkpoint"] = ddp_layout.restore(out["fresh"], {"model": ("module", make())}, 4, 0, 1)
out["unused"] = ddp_layout.record({"model": ("module", make(find_unused_parameters=True))})
static = make(static_graph=True)
train(static, 4)  # a static graph rebuilds one iteration later: DDP logs it at the fourth
static_meta = ddp_layout.record({"model": ("module", static)})
static_again = make(static_graph=True)
out["static_limits"] = ddp_layout.restore(static_meta, {"model": ("module", static_again)}, 3, 0, 3)
out["static"] = [buckets(static), buckets(static_again)]
train(static_again, 3)  # a static graph's first iteration and rebuild run on the new reducer
out["static_after"] = buckets(static_again)
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_layout_recorded_once_rebuilt_and_given_back_to_a_new_reducer(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "pg")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # DDP starts with one bucket in parameter order and rebuilds, after its first iteration, in
    # the order the gradients became ready, cut at the bucket cap
    assert out["initial"] == [[0, 1, 2, 3]]
    rebuilt = out["rebuilt"]
    assert len(rebuilt) > 1 and sorted(i for b in rebuilt for i in b) == [0, 1, 2, 3], rebuilt
    # before DDP's logging data shows the rebuilt layout, a save records that it is unknown
    assert out["fresh"] == {"model": {"buckets": None}} and out["step2"] == {"model": {"buckets": None}}
    assert out["step3"] == {"model": {"buckets": rebuilt}}
    # a new DDP gets that layout before its first step, keeps it, and a save of it records it
    assert out["limits"] == [] and out["restored"] == rebuilt and out["after"] == rebuilt
    assert out["remembered"] == {"model": {"buckets": rebuilt}}
    # where the reducer cannot be built again, or nothing was recorded: one line says why (at 3
    # ranks and more; a sum over two ranks does not depend on the order)
    (hooked,) = out["hooked"]
    assert "communication hook (allreduce_hook)" in hooked and "over the 3 ranks" in hooked
    assert "not bit-exact" in hooked
    assert out["hooked_two_ranks"] == []
    assert ["written by an older version" in line for line in out["old_checkpoint"]] == [True]
    assert ["its first two steps" in line for line in out["early_checkpoint"]] == [True]
    # a DDP that never rebuilds (find_unused_parameters) reduces in one layout throughout
    assert out["unused"] == {}
    # static_graph: the reducer is built again as DDP's own __setstate__ builds it
    assert out["static_limits"] == [] and out["static"][0] == out["static"][1] == out["static_after"]


def test_parse_layout_reads_ddps_logging_form() -> None:
    assert parse_layout("5 4 3 2, 1 0") == [[5, 4, 3, 2], [1, 0]]
    assert parse_layout("3 2 1 0") == [[3, 2, 1, 0]]
    assert parse_layout("") == []
