"""Several optimizers in one iteration (an encoder and a head, each with its own Adam; a third
branch with its own): with saves before the update armed (a planned-update jolt), every committed
checkpoint equals, bit for bit, the state at the end of the step it is labelled with — whatever
order the optimizers step in, through the API and in zero-code mode under ``smartckpt run``.

The save before the update is decided in the last optimizer's pre-hook; when an earlier optimizer
has already stepped, the state is no longer the boundary's: the precursor is not taken (one line
says why) and the alarm is taken at the step boundary.
"""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import smartckpt_cli as sc
from smartckpt_cli.engine.restore import load_checkpoint
from smartckpt_cli.store.directory import open_store

JOLTS = (16, 26)
STEPS = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.side = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)) + self.side(x)


def build(n_opt: int) -> tuple[Net, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = Net()
    groups = [model.encoder.parameters(), model.head.parameters(), model.side.parameters()]
    if n_opt == 2:  # the side branch goes with the head
        groups = [
            model.encoder.parameters(),
            itertools.chain(model.head.parameters(), model.side.parameters()),
        ]
    return model, [torch.optim.Adam(list(g), lr=1e-3) for g in groups]


def iterate(model: Net, opts: list[torch.optim.Optimizer], order: list[int], step: int) -> torch.Tensor:
    """One training step: the optimizers step in ``order``; at the JOLTS the first to step runs
    at 400x its learning rate (a surge the planned update shows before it happens)."""
    x = torch.randn(16, 8)
    loss = (model(x) - x[:, :1]).pow(2).mean()
    loss.backward()
    for rank, i in enumerate(order):
        lrs = [g["lr"] for g in opts[i].param_groups]
        if step in JOLTS and rank == 0:
            for g in opts[i].param_groups:
                g["lr"] *= 400.0
        opts[i].step()
        for g, lr in zip(opts[i].param_groups, lrs, strict=True):
            g["lr"] = lr
    for o in opts:
        o.zero_grad()
    return loss.detach()


def fingerprint(model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, list[str]]:
    """The state at a step's end, bitwise: each weight by name, the optimizers' tensors as a
    sorted list of (shape, bytes) digests (zero-code names optimizers itself)."""

    def digest(t: torch.Tensor) -> str:
        return f"{tuple(t.shape)}:{hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()}"

    out = {f"model/{k}": [digest(v)] for k, v in model.state_dict().items()}
    out["optimizers"] = sorted(
        digest(v)
        for o in opts
        for st in o.state_dict()["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    return out


def committed_fingerprints(store: Path) -> dict[int, dict[str, list[str]]]:
    st = open_store(store)
    state = st.journal.read()
    out = {}
    for rec in state.live():
        tensors = load_checkpoint(st.storage, st.blobs, rec, state.store_id).tensors
        model = {
            k: [f"{tuple(t.shape)}:{hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()}"]
            for k, t in tensors.items()
            if k.startswith("model/")
        }
        opt = sorted(
            f"{tuple(t.shape)}:{hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()}"
            for k, t in tensors.items()
            if not k.startswith(("model/", "rng/"))
        )
        out[rec.step] = {**model, "optimizers": opt}
    return out


ORDERS = [(2, [0, 1]), (2, [1, 0]), (3, [0, 1, 2]), (3, [2, 0, 1])]


def reference(n_opt: int, order: list[int]) -> dict[int, dict[str, list[str]]]:
    model, opts = build(n_opt)
    torch.manual_seed(1)
    ref = {}
    for step in range(1, STEPS + 1):
        iterate(model, opts, order, step)
        ref[step] = fingerprint(model, opts)
    return ref


@pytest.mark.parametrize(
    ("n_opt", "order"), ORDERS, ids=[f"{n}opt-{''.join(map(str, o))}" for n, o in ORDERS]
)
def test_api_every_checkpoint_is_its_steps_state(
    tmp_path: Path, n_opt: int, order: list[int], caplog
) -> None:
    ref = reference(n_opt, order)
    model, opts = build(n_opt)
    torch.manual_seed(1)
    mgr = sc.CheckpointManager(tmp_path, eval_every=1, min_interval=0.0, max_interval=1e9, keep_last=50)
    mgr.register(model=model, **{f"opt{i}": o for i, o in enumerate(opts)})
    for step in range(1, STEPS + 1):
        loss = iterate(model, opts, order, step)
        mgr.step(step, loss=loss)
    assert mgr.close() == []
    got = committed_fingerprints(tmp_path)
    reasons = {r.step: r.reason for r in open_store(tmp_path).journal.read().live()}
    assert len(got) >= 2, reasons
    for step, fp in got.items():
        assert fp == ref[step], f"checkpoint of step {step} ({reasons[step]}) is not the state at its end"
    assert all("alarm" in r for r in reasons.values()), reasons  # taken at the step boundary
    print(f"several optimizers (API, {n_opt}, order {order}): {len(got)} checkpoints, each its step's state")
    assert "already stepped in this iteration" in caplog.text  # the precursor was refused, said once
    assert caplog.text.count("already stepped in this iteration") == 1


SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.test_precursor_optimizers import STEPS, build, fingerprint, iterate
import smartckpt_cli
n_opt, order = {n_opt}, {order!r}
model, opts = build(n_opt)
torch.manual_seed(1)
start = smartckpt_cli.start_step()
assert start == 0
for step in range(1, STEPS + 1):
    iterate(model, opts, order, step)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("n_opt", "order"), [ORDERS[1], ORDERS[3]], ids=["2opt-10", "3opt-201"])
def test_zero_code_every_checkpoint_is_its_steps_state(
    tmp_path: Path, n_opt: int, order: list[int], child_env: dict[str, str]
) -> None:
    ref = reference(n_opt, order)
    root = str(Path(__file__).resolve().parents[1])
    (tmp_path / "train.py").write_text(SCRIPT.format(root=root, n_opt=n_opt, order=order))
    env = {
        **child_env,
        "SMARTCKPT_EVAL_EVERY": "1",
        "SMARTCKPT_MIN_INTERVAL": "0",
        "SMARTCKPT_MAX_INTERVAL": "1e9",
        "SMARTCKPT_KEEP_LAST": "50",
    }
    done = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = committed_fingerprints(tmp_path / "ck")
    assert len(got) >= 3, got.keys()  # the two alarms and the final checkpoint at exit
    for step, fp in got.items():
        assert fp == ref[step], f"checkpoint of step {step} is not the state at its end"
    assert "already stepped in this iteration" in done.stdout + done.stderr
    print(
        f"several optimizers (zero-code, {n_opt}, order {order}): {len(got)} checkpoints, each its step's state"
    )
