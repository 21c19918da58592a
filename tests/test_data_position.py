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


def _epochs(loader, sampler, epochs, first_epoch=0, *, skip_iter=False):
    """The training loop as README shows it: ``for epoch: for batch in loader``, each batch followed
    by a draw from the global RNG (dropout's stand-in). Returns [(batch, draw)]."""
    out = []
    for epoch in range(first_epoch, epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for b in loader:
            out.append((b[0].tolist(), torch.rand(()).item()))
    return out


@pytest.mark.parametrize("at", ["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("kind", ["shuffle", "seeded", "distributed", "shuffle-workers"])
def test_an_unseeded_loader_created_after_restore_resumes_the_data_and_the_rng_exactly(tmp_path, kind, at):
    """No generator of its own: the loader's iterator draws its base seed (and a RandomSampler its
    permutation seed) from the global RNG at each epoch start. The resumed run creates that
    iterator after restore(); the draws are part of the data position, so the batches *and* every
    global RNG draw after them (dropout) are those of an uninterrupted run. Saved right after an
    epoch's last batch, the resume begins the next epoch, as ``start // batches_per_epoch`` does."""

    def make():
        if kind == "distributed":
            sampler = DistributedSampler(_ds(), num_replicas=2, rank=0, shuffle=True, seed=3)
            return DataLoader(_ds(), batch_size=4, sampler=sampler), sampler
        workers = 1 if kind == "shuffle-workers" else 0
        init = (lambda _i: torch.manual_seed(torch.initial_seed())) if workers else None
        gen = torch.Generator().manual_seed(7) if kind == "seeded" else None
        loader = DataLoader(
            _ds(), batch_size=4, shuffle=True, num_workers=workers, worker_init_fn=init, generator=gen
        )
        return loader, None

    per_epoch = 6 if kind == "distributed" else 12
    saved = per_epoch + 4 if at == "mid-epoch" else per_epoch
    torch.manual_seed(0)
    loader, sampler = make()
    reference = _epochs(loader, sampler, 3)

    torch.manual_seed(0)
    loader, sampler = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        seen = []
        for epoch in range(2):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for b in loader:
                seen.append((b[0].tolist(), torch.rand(()).item()))
                if len(seen) == saved:
                    mgr.save(saved, blocking=True)  # inside the loop body, as a step's save is
                    break
            if len(seen) == saved:
                break
    assert seen == reference[:saved]

    torch.manual_seed(1234)  # another state: the restore brings the checkpoint's back
    loader, sampler = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        start = mgr.restore()
        assert start == saved
    rest = _epochs(loader, sampler, 3, first_epoch=start // per_epoch)
    assert rest == reference[saved:]


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
