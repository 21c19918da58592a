"""A save costs what changed (engine/unchanged.py): a frozen base is referenced, not copied, once
a checkpoint holds it; changed behind its version counter, it is caught by the rotation within
``reverify_saves`` saves, said once, stored, and restored exactly from then on."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

import smartckpt_cli as sc


class Lora(torch.nn.Module):
    """A LoRA-shaped model: a frozen base (91 % of the bytes) and small trained adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(256, 256)
        self.norm = torch.nn.BatchNorm1d(256)
        self.a = torch.nn.Linear(256, 4, bias=False)
        self.b = torch.nn.Linear(4, 256, bias=False)
        for p in [*self.base.parameters(), *self.norm.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.base(x) + self.b(self.a(x)))


def _setup(tmp_path, **settings):
    torch.manual_seed(0)
    model = Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mgr = sc.CheckpointManager(tmp_path / "ck", keep_last=50, reverify_saves=4, **settings)
    mgr.register(model=model, optimizer=opt)
    return model, opt, mgr


def _train(model, opt, mgr, step: int, *, eval_norm: bool = True) -> None:
    model.norm.train(not eval_norm)  # in eval mode BatchNorm's statistics stay: referenced too
    loss = model(torch.randn(8, 256)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mgr.step(step, loss=loss)


def _staged(handle) -> set[str]:
    return set(handle.copied)


def test_a_frozen_base_is_referenced_once_committed_and_restores_exactly(tmp_path, isolated):
    model, opt, mgr = _setup(tmp_path)
    base = {"model/base.weight", "model/base.bias"}
    seen = []
    for step in range(1, 9):
        _train(model, opt, mgr, step)
        h = mgr.save(step, blocking=True)
        seen.append(_staged(h))
    assert base <= seen[0]  # the first save copies everything
    assert not any(base & s for s in seen[1:]), (
        seen
    )  # then never: referenced (the rotation reads, not copies)
    assert all({"model/a.weight", "model/b.weight"} <= s for s in seen)  # trained: always copied
    assert h.bytes_copied < 0.5 * (h.bytes_copied + h.bytes_referenced), (h.bytes_copied, h.bytes_referenced)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.close()

    torch.manual_seed(1)
    fresh = Lora()
    with sc.CheckpointManager(tmp_path / "ck") as m2:
        m2.register(model=fresh)
        assert m2.restore() == 8
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k


def _change(how: str, weight: torch.nn.Parameter) -> None:
    if how == "data":
        weight.data.add_(0.5)
    elif how == "numpy":
        weight.detach().numpy()[0, :] += 1.0
    else:  # an external kernel: bytes written straight into the storage
        ones = torch.full((256,), 3.0)
        ctypes.memmove(weight.data_ptr(), ones.data_ptr(), ones.numel() * 4)


@pytest.mark.parametrize("how", ["data", "numpy", "kernel"])
def test_a_frozen_weight_changed_behind_its_counter_is_caught_said_and_stored(
    tmp_path, isolated, caplog, how
):
    model, opt, mgr = _setup(tmp_path)
    for step in range(1, 4):
        _train(model, opt, mgr, step)
        mgr.save(step, blocking=True)
    version = model.base.weight._version
    _change(how, model.base.weight)
    assert model.base.weight._version == version  # the counter did not move: nothing else tells
    changed = model.base.weight.detach().clone()
    caught_at = None
    with caplog.at_level(logging.WARNING):
        for step in range(4, 4 + 4 + 2):  # the rotation reads every referenced chunk in 4 saves
            _train(model, opt, mgr, step)
            h = mgr.save(step, blocking=True)
            if caught_at is not None:
                assert "model/base.weight" in _staged(h)  # copied from the save after on
            if caught_at is None and "changed without its version counter moving" in caplog.text:
                caught_at = step
    assert caught_at is not None and caught_at <= 3 + 4, caught_at
    assert caplog.text.count("model/base.weight changed without its version counter moving") == 1
    mgr.close()

    fresh = Lora()
    with sc.CheckpointManager(tmp_path / "ck") as m2:
        m2.register(model=fresh)
        m2.restore()
    assert torch.equal(fresh.base.weight, changed)


def test_batchnorm_statistics_in_training_are_never_stale(tmp_path, isolated):
    """BatchNorm updates its running statistics without bumping their counters; its
    num_batches_tracked moves beside them, so the whole module counts as changed."""
    model, opt, mgr = _setup(tmp_path)
    for step in range(1, 6):
        _train(model, opt, mgr, step, eval_norm=False)
        h = mgr.save(step, blocking=True)
        assert {"model/norm.running_mean", "model/norm.running_var"} <= _staged(h)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.close()
    fresh = Lora()
    with sc.CheckpointManager(tmp_path / "ck") as m2:
        m2.register(model=fresh)
        m2.restore()
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k


class _Fresh:
    """A state whose ``state_dict`` makes a new tensor each time (as the RNG's does): the freed
    one's address is reused by the next, with a version counter of 0 again."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"v": torch.full((1024,), float(self.value))}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["v"][0])


def test_a_fresh_tensor_at_a_freed_ones_address_is_not_taken_for_unchanged(tmp_path, isolated):
    fresh = _Fresh()
    with sc.CheckpointManager(tmp_path / "ck", keep_last=50) as mgr:
        mgr.register(state=fresh)
        for step in range(1, 8):
            fresh.value = step
            h = mgr.save(step, blocking=True)
            assert "state/v" in h.copied, step
    back = _Fresh()
    with sc.CheckpointManager(tmp_path / "ck") as m2:
        m2.register(state=back)
        assert m2.restore() == 7
    assert back.value == 7
