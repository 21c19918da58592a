"""Zero-code names the training objects the same way in every run: the script's variable names
(two optimizers of one shape, a train and a val loader), else creation order — never the order the
garbage collector lists objects in. A loader whose dataset is another one is refused on restore.

Real processes under ``smartckpt run`` with a real SIGKILL, and the discovery functions in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc
from smartckpt_cli.agent.naming import _created, _names, script_names, stamp_creation
from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.store.directory import open_store

pytestmark = pytest.mark.usefixtures("isolated")


def test_variables_name_objects_of_one_kind_and_creation_order_orders_them():
    stamp_creation()
    g = torch.nn.Linear(4, 4)
    d = torch.nn.Linear(4, 4)
    opt_g = torch.optim.Adam(g.parameters())  # the same shapes: only their names tell them apart
    opt_d = torch.optim.Adam(d.parameters())
    assert _created(opt_g) < _created(opt_d)
    found = script_names([opt_d, opt_g])
    assert found == {id(opt_g): "opt_g", id(opt_d): "opt_d"}
    assert _names("optimizer", [opt_g, opt_d], found) == ["opt_g", "opt_d"]
    assert _names("optimizer", [opt_g], found) == ["optimizer"]  # one of a kind keeps its kind's name
    shared = {id(opt_g): "x", id(opt_d): "x"}
    assert _names("optimizer", [opt_g, opt_d], shared) == ["optimizer0", "optimizer1"]  # ambiguous


def _loader(n: int) -> DataLoader:
    ds = TensorDataset(torch.randn(n, 4))
    return DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))


def test_a_loader_of_another_dataset_is_refused_naming_it(tmp_path: Path):
    model = torch.nn.Linear(4, 1)
    loader = _loader(96)
    with sc.CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.register(model=model, val_loader=loader)
        next(iter(loader))
        mgr.save(1, blocking=True)
    other = _loader(64)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=torch.nn.Linear(4, 1), val_loader=other)
        with pytest.raises(
            StateMismatchError,
            match="DataLoader 'val_loader': its dataset has 64 samples, the checkpoint's loader had 96",
        ):
            mgr.restore()


SCRIPT = """
import os, signal, sys, torch, smartckpt_cli
from torch.utils.data import DataLoader, TensorDataset

def loader(n, seed):
    ds = TensorDataset(torch.randn(n, 6, generator=torch.Generator().manual_seed(seed)))
    return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))

def main():
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
    # two optimizers of exactly the same shape and type, two loaders: swapped, they still load
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    opt_g = torch.optim.Adam(gen.parameters(), lr=3e-3)
    val_loader = loader(40, 2)
    train_loader = loader(64, 1)
    start = smartckpt_cli.start_step()
    print("start", start, flush=True)
    it, vit = iter(train_loader), iter(val_loader)
    for step in range(start, 30):
        try:
            (x,) = next(it)
        except StopIteration:
            it = iter(train_loader); (x,) = next(it)
        try:
            (v,) = next(vit)
        except StopIteration:
            vit = iter(val_loader); (v,) = next(vit)
        opt_d.zero_grad()  # a GAN's usual step: each optimizer zeroes its grads before its backward
        (disc(x.detach()) - gen(x).detach()).pow(2).mean().backward()
        opt_d.step()
        opt_g.zero_grad()
        (disc(gen(x)) - v.mean()).pow(2).mean().backward()
        opt_g.step()
        if step + 1 == 17 and os.environ.get("SMARTCKPT_ATTEMPT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"gen": gen.state_dict(), "disc": disc.state_dict(), "opt_g": opt_g.state_dict(),
                "opt_d": opt_d.state_dict()}, sys.argv[1])

main()
"""


@pytest.mark.slow
def test_a_gan_with_two_same_shape_optimizers_and_two_loaders_resumes_exactly(tmp_path: Path, child_env):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**child_env, "SMARTCKPT_RESTART_BACKOFF": "0.1"}
    reference = subprocess.run(
        [sys.executable, "train.py", "ref.pt"], cwd=tmp_path, env={**env, "SMARTCKPT_ATTEMPT": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    run = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "5", "train.py", "out.pt"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    starts = [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("start ")]
    assert starts[0] == 0 and starts[1] in (10, 15), out  # killed at 17, resumed from a checkpoint
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "out.pt")
    for part in ("gen", "disc"):
        for k, v in ref[part].items():
            assert torch.equal(got[part][k], v), f"{part}.{k} differs from the uninterrupted run"
    for part in ("opt_g", "opt_d"):
        for i, st in ref[part]["state"].items():
            assert all(torch.equal(got[part]["state"][i][k], v) for k, v in st.items()), part
    # the names are the script's own, recorded in every manifest
    st = open_store(tmp_path / "ck")
    rec = st.journal.read().live()[-1]
    names = set(json.loads((tmp_path / "ck" / rec.manifest).read_bytes())["objects"])
    assert {"opt_g", "opt_d", "train_loader", "val_loader"} <= names, names
