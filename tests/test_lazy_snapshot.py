"""The lazy snapshot: parameters and optimizer state are copied in the background while the next
forward/backward runs; the optimizer step pre-hook waits for the copy. The checkpoint must hold
the state at the step it was taken, never a later one."""

from __future__ import annotations

import torch

import smartckpt_cli as sc


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt):
    model.train()
    model(torch.randn(64, 256)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_checkpoint_holds_the_state_of_its_step_not_a_later_one(tmp_path):
    model, opt = _setup()
    with sc.CheckpointManager(tmp_path, every_steps=1, compression_level=3) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train_step(model, opt)
        expected_model = {k: v.clone() for k, v in model.state_dict().items()}
        expected_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        res = mgr.step(1)
        assert res.saved and res.handle is not None and res.handle.lazy
        for _ in range(3):  # forward mutates BatchNorm buffers, the optimizer step the parameters
            _train_step(model, opt)
        info = res.handle.wait()
        assert info is not None and info.step == 1
        assert res.handle.loop_wait_seconds >= res.handle.blocking_seconds
    assert not torch.equal(model.state_dict()["0.weight"], expected_model["0.weight"])

    fresh, fresh_opt = _setup(seed=1)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=fresh, optimizer=fresh_opt)
        assert mgr.restore() == 1
    for k, v in expected_model.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for k, v in expected_opt.items():
        assert torch.equal(fresh_opt.state_dict()["state"][0][k], v), k


def test_explicit_save_is_eager_and_hooks_are_removed_on_close(tmp_path):
    model, opt = _setup()
    mgr = sc.CheckpointManager(tmp_path)
    mgr.register(model=model, optimizer=opt)
    handle = mgr.save(1)
    assert not handle.lazy
    assert len(opt._optimizer_step_pre_hooks) == 1
    mgr.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert handle.wait() is not None
