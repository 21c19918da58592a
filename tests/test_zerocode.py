"""agent/zerocode.py: discovery of the training objects and their registration with a real
CheckpointManager through its public ``register_as``/``names``."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc
from smartckpt_cli.agent.zerocode import ZeroCode, _Found, discover
from smartckpt_cli.state.registry import MODULE, RNG

pytestmark = pytest.mark.usefixtures("isolated")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def _training() -> tuple[Net, torch.optim.Optimizer, Any, DataLoader[Any]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    return model, opt, sched, loader


def _mine(found: _Found, model: Any, opt: Any, sched: Any, loader: Any | None) -> _Found:
    """What discovery found of this test's objects (other tests' leftovers may be alive too)."""
    return _Found(
        [o for o in found.optimizers if o is opt],
        [m for m in found.modules if m is model],
        [s for s in found.schedulers if s is sched],
        [],
        [d for d in found.loaders if d is loader] if loader is not None else [],
    )


def _zc(found: _Found, mgr: sc.CheckpointManager, losses: list[torch.Tensor]) -> ZeroCode:
    def fail(what: str, err: BaseException) -> None:
        raise AssertionError(f"{what}: {err}")

    return ZeroCode(found, mgr, loss=lambda: losses[-1] if losses else None, on_error=fail)


def test_discover_finds_top_level_model_its_optimizer_scheduler_and_loader() -> None:
    model, opt, sched, loader = _training()
    stray = torch.nn.Linear(3, 3)  # a module no optimizer trains
    gc.collect()
    found = discover(with_loaders=True)
    assert any(o is opt for o in found.optimizers)
    assert any(m is model for m in found.modules)
    assert not any(m is model.body or m is model.head for m in found.modules), "only top-level modules"
    assert not any(m is stray for m in found.modules)
    assert any(s is sched for s in found.schedulers)
    assert any(d is loader for d in found.loaders)
    assert not any(d is loader for d in discover(with_loaders=False).loaders)


def test_discovered_objects_are_registered_through_register_as(tmp_path: Path) -> None:
    model, opt, sched, loader = _training()
    gc.collect()
    found = _mine(discover(with_loaders=True), model, opt, sched, loader)
    with sc.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.names() == [RNG]
        zc = _zc(found, mgr, [])
        assert mgr.names() == [RNG, "model", "optimizer", "scheduler", "data"]
        # the wrappers are registered as they are, with the kind of what they wrap
        assert mgr.registered("model") is zc.modules[0]
        assert mgr.registered("model").module is model
        assert mgr.registered("optimizer") is opt
        assert mgr.registered(RNG).live is zc.live[RNG]
        assert mgr.registered("data").live is zc.live["data"]
        hooks = len(opt._optimizer_step_pre_hooks)
        # a second discovery of the same objects registers nothing twice
        _zc(_mine(discover(with_loaders=True), model, opt, sched, loader), mgr, [])
        assert mgr.names() == [RNG, "model", "optimizer", "scheduler", "data"]
        assert len(opt._optimizer_step_pre_hooks) == hooks, "the optimizer was hooked twice"


def test_register_as_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    model, *_ = _training()
    with sc.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(ValueError, match="unknown kind"):
            mgr.register_as("model", model, kind="weights")
        with pytest.raises(ValueError, match="'rng' is reserved"):
            mgr.register_as(RNG, model, kind=MODULE)
        with pytest.raises(ValueError, match="'rng' is reserved"):
            mgr.register(rng=model)
        with pytest.raises(ValueError, match="no '/'"):
            mgr.register_as("a/b", model)
        mgr.register_as("net", model)  # without a kind: as register() does
        assert mgr.names() == [RNG, "net"]


def test_zero_code_final_checkpoint_restores_into_plain_objects(tmp_path: Path) -> None:
    model, opt, sched, _ = _training()
    gc.collect()
    found = _mine(discover(with_loaders=False), model, opt, sched, None)
    losses: list[torch.Tensor] = []
    mgr = sc.CheckpointManager(tmp_path / "ckpt")
    mgr.heartbeat = False
    zc = _zc(found, mgr, losses)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        zc.before_step(opt)  # what the global pre-hook calls
        opt.step()
        zc.after_step(opt)  # ... and the post-hook
        sched.step()
        opt.zero_grad()
    zc.finish(final_save=True)  # the final checkpoint of step 3, then close
    model2, opt2, sched2, _ = _training()
    with sc.CheckpointManager(tmp_path / "ckpt") as again:
        again.register(model=model2, optimizer=opt2, scheduler=sched2)
        assert again.restore() == 3
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert sched2.state_dict()["last_epoch"] == 3
    assert opt2.state_dict()["state"][0]["step"] == 3
