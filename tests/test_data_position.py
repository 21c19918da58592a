"""Data position: the batch after a resume is the one an uninterrupted run would have seen."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import smartckpt_cli as sc


def _ds():
    return TensorDataset(torch.arange(48))


def _consume(loader, n):
    """n batches the way a training loop takes them: next() until StopIteration, then a new epoch."""
    out, it = [], iter(loader)
    while len(out) < n:
        try:
            out.append(next(it)[0].tolist())
        except StopIteration:
            it = iter(loader)
    return out, it


def test_distributed_sampler_resumes_mid_epoch(tmp_path):
    def make():
        sampler = DistributedSampler(_ds(), num_replicas=2, rank=1, shuffle=True, seed=3)
        return DataLoader(_ds(), batch_size=4, sampler=sampler), sampler

    ref_loader, ref_sampler = make()
    reference = []
    for epoch in range(3):
        ref_sampler.set_epoch(epoch)
        reference += [b[0].tolist() for b in ref_loader]  # 6 batches per epoch on this rank

    loader, sampler = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        seen = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            it = iter(loader)
            for _ in range(6 if epoch == 0 else 4):
                seen.append(next(it)[0].tolist())
        mgr.save(10, blocking=True)
    assert seen == reference[:10]

    loader, sampler = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        assert mgr.restore() == 10
    rest = [b[0].tolist() for b in loader]  # the rest of epoch 1
    sampler.set_epoch(2)
    rest += [b[0].tolist() for b in loader]
    assert rest == reference[10:]


def test_stateful_dataloader_uses_its_own_state_dict(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return sdl.StatefulDataLoader(
            _ds(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    reference, _ = _consume(make(), 30)
    loader = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        assert mgr.registered("data") is loader  # has state_dict: checkpointed as it is
        seen, _it = _consume(loader, 17)
        mgr.save(17, blocking=True)
    assert seen == reference[:17]

    loader = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        assert mgr.restore() == 17
    # The rest of the epoch continues exactly. (The order of the epochs after it is
    # StatefulDataLoader's own business, and differs from an uninterrupted run even without
    # smartckpt: its state_dict does not carry the generator's progress across epochs.)
    rest, _ = _consume(loader, 7)
    assert rest == reference[17:24]


def test_unseeded_shuffling_warns_at_registration(tmp_path, caplog):
    loader = DataLoader(_ds(), batch_size=4, shuffle=True)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
    assert "without a seeded generator" in caplog.text


def test_a_loader_registered_twice_is_tracked_once(tmp_path):
    """Two managers in one process (a user's and an integration's, say) see the same loader: its
    batches are counted once, so a resume skips exactly what was consumed."""
    loader = DataLoader(_ds(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    with sc.CheckpointManager(tmp_path / "a") as a, sc.CheckpointManager(tmp_path / "b") as b:
        a.register(data=loader)
        b.register(data=loader)
        assert a.registered("data") is b.registered("data")
        _consume(loader, 3)
        assert (a.registered("data").epochs, a.registered("data").batches) == (1, 3)
