"""Data position at another world size: a DistributedSampler epoch interrupted at N ranks finishes
at M ranks with no sample seen twice or skipped, and the epochs after it are an M-rank run's.

Real DataLoaders and real DistributedSamplers with explicit ``num_replicas``/``rank``: every rank
is simulated in this process, no process group needed.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import smartckpt_cli as sc
from smartckpt_cli.errors import StateMismatchError
from smartckpt_cli.state.data import LoaderState, load_stateful_loader
from smartckpt_cli.state.data_reshard import deal, epoch_order, remainder_indices

EPOCH = 2
SEED = 7


def _loader(n, world, rank, *, bs=4, sampler_drop_last=False, loader_drop_last=False, **kw):
    ds = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=sampler_drop_last
    )
    return DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=loader_drop_last, **kw), sampler


def _interrupted(n, world, k, **kw):
    """Every rank of a ``world``-rank run takes ``k`` batches of epoch EPOCH: (ids seen, states)."""
    seen, states = [], []
    for rank in range(world):
        loader, sampler = _loader(n, world, rank, **kw)
        tracker = LoaderState.of(loader)
        sampler.set_epoch(EPOCH)
        it = iter(loader)
        for _ in range(k):
            seen += next(it)[0].tolist()
        states.append(tracker.state_dict())
    return seen, states


def _resumed(states, world, n, *, take=None, **kw):
    """Each rank of a ``world``-rank run loads an old rank's state and iterates the rest of the
    epoch (``take`` batches of it, if given): (batches per rank, states, trackers, loaders)."""
    out, new_states, trackers, loaders = [], [], [], []
    for rank in range(world):
        loader, _ = _loader(n, world, rank, **kw)
        tracker = LoaderState.of(loader)
        tracker.load_state_dict(states[rank % len(states)])
        it = iter(loader)
        batches = [b[0].tolist() for b in (it if take is None else (next(it) for _ in range(take)))]
        out.append(batches)
        new_states.append(tracker.state_dict())
        trackers.append(tracker)
        loaders.append(loader)
    assert len({len(b) for b in out}) == 1, "every new rank gets the same number of batches"
    return out, new_states, trackers, loaders


def _ids(per_rank):
    return [i for batches in per_rank for b in batches for i in b]


@pytest.mark.parametrize(("n", "old", "new", "k"), [(48, 2, 3, 3), (60, 3, 2, 2), (48, 2, 1, 2)])
def test_an_epoch_finished_at_another_world_size_is_seen_exactly_once(n, old, new, k):
    seen, states = _interrupted(n, old, k)
    rest, _, trackers, _ = _resumed(states, new, n)
    assert Counter(seen + _ids(rest)) == Counter(range(n))
    consumed = old * k * 4
    assert trackers[0].describe_reshard() == (
        f"data position carried: epoch {EPOCH}, {consumed} of {n} samples consumed, rest dealt to {new} ranks"
    )
    # Rank r' takes rest[r'::M] of the global order.
    order = epoch_order(n, SEED, EPOCH, True)
    assert [i for b in rest[-1] for i in b] == order[consumed:][new - 1 :: new]


def test_padding_and_truncation_follow_distributed_sampler():
    order = epoch_order(50, SEED, EPOCH, True)
    seen, states = _interrupted(50, 2, 3)  # 24 consumed, 26 left: 3 ranks get 9 each
    rest, *_ = _resumed(states, 3, 50)
    assert [len(b) for b in rest[0]] == [4, 4, 1]
    # Padded as DistributedSampler pads: the rest's first sample once more.
    assert Counter(seen + _ids(rest)) == Counter(range(50)) + Counter([order[24]])

    seen, states = _interrupted(50, 2, 3, sampler_drop_last=True)
    rest, *_ = _resumed(states, 3, 50, sampler_drop_last=True)  # 26 left, truncated to 24
    assert Counter(seen + _ids(rest)) == Counter(range(50)) - Counter(order[48:])

    _, states = _interrupted(50, 2, 3)
    rest, *_ = _resumed(states, 3, 50, loader_drop_last=True)  # the loader drops the partial batch
    assert [len(b) for b in rest[2]] == [4, 4]


def test_a_finished_epoch_leaves_nothing_to_carry():
    """A rank whose iterator ran out finished its share, the loader's dropped last batch included:
    the rest of the epoch is empty at the new world size."""
    states = []
    for rank in range(2):
        loader, sampler = _loader(50, 2, rank, loader_drop_last=True)  # 25 per rank: 6 batches
        tracker = LoaderState.of(loader)
        sampler.set_epoch(EPOCH)
        assert len([b for b in loader]) == 6
        states.append(tracker.state_dict())
    assert states[0]["position"]["samples"] == 25
    rest, _, trackers, _ = _resumed(states, 3, 50)
    assert rest == [[], [], []]
    assert "50 of 50 samples consumed" in trackers[0].describe_reshard()


def test_the_next_epoch_is_the_new_world_size_run():
    _, states = _interrupted(48, 2, 3)
    _, _, _, loaders = _resumed(states, 3, 48)
    for rank, loader in enumerate(loaders):
        loader.sampler.set_epoch(EPOCH + 1)
        ref, ref_sampler = _loader(48, 3, rank)
        ref_sampler.set_epoch(EPOCH + 1)
        assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in ref]
        assert len(loader) == len(ref)


def test_a_changed_batch_size_is_cut_from_the_samples():
    seen, states = _interrupted(60, 2, 3)  # 24 consumed, 36 left: 12 per rank
    rest, *_ = _resumed(states, 3, 60, bs=5)
    assert [len(b) for b in rest[0]] == [5, 5, 2]
    assert Counter(seen + _ids(rest)) == Counter(range(60))
    rest, *_ = _resumed(states, 3, 60, bs=5, loader_drop_last=True)
    assert [len(b) for b in rest[1]] == [5, 5]
    # The same world at another batch size continues sample by sample.
    rest, *_ = _resumed(states, 2, 60, bs=5)
    assert Counter(seen + _ids(rest)) == Counter(range(60))


def test_nested_elastic_resumes_cover_the_epoch():
    seen2, states2 = _interrupted(64, 2, 2)  # 16 consumed; 48 left: 16 per rank at 3
    part3, states3, *_ = _resumed(states2, 3, 64, take=1)  # 12 more: 28 consumed, 36 left
    rest, _, trackers, _ = _resumed(states3, 2, 64)
    assert Counter(seen2 + _ids(part3) + _ids(rest)) == Counter(range(64))
    assert "28 of 64 samples consumed, rest dealt to 2 ranks" in trackers[0].describe_reshard()


def test_a_resume_after_an_elastic_resume_continues_the_dealing():
    """Same world, prefix > 0: the result equals the uninterrupted remainder, padding included."""
    _, states2 = _interrupted(50, 2, 2)  # 16 consumed; 34 left at 3 ranks: padded to 36
    whole, *_ = _resumed(states2, 3, 50)
    part, states3, *_ = _resumed(states2, 3, 50, take=1)
    rest, _, trackers, _ = _resumed(states3, 3, 50)
    assert [p + r for p, r in zip(part, rest, strict=True)] == whole
    assert trackers[0].describe_reshard() is None


def test_the_same_world_size_restores_exactly_as_before():
    def reference(rank):
        loader, sampler = _loader(50, 2, rank)
        sampler.set_epoch(EPOCH)
        return [b[0].tolist() for b in loader]

    _, states = _interrupted(50, 2, 3)
    assert states[0]["world"] == 2 and states[0]["position"]["samples"] == 12
    rest, *_ = _resumed(states, 2, 50)
    for rank in range(2):
        assert rest[rank] == reference(rank)[3:]
    # A state written before the position was recorded loads the same way.
    old = [{k: v for k, v in s.items() if k not in ("world", "position")} for s in states]
    assert _resumed(old, 2, 50)[0] == rest


def test_persistent_workers_take_the_rest_once():
    _, states = _interrupted(48, 2, 3)
    loader, sampler = _loader(48, 3, 1, num_workers=1, persistent_workers=True)
    LoaderState.of(loader).load_state_dict(states[1])
    first = [b[0].tolist() for b in loader]
    sampler.set_epoch(EPOCH + 1)
    second = [b[0].tolist() for b in loader]
    ref, ref_sampler = _loader(48, 3, 1)
    ref_sampler.set_epoch(EPOCH + 1)
    assert len(first) == 2 and second == [b[0].tolist() for b in ref]


@pytest.mark.parametrize("persistent", [False, True])
def test_the_same_world_size_with_workers_skips_the_consumed_batches(persistent):
    """A multiprocessing iterator iterates its index sampler twice while it is created: the skip
    holds for both."""
    _, states = _interrupted(48, 2, 3)
    loader, _ = _loader(48, 2, 0, num_workers=1, persistent_workers=persistent)
    LoaderState.of(loader).load_state_dict(states[0])
    ref, ref_sampler = _loader(48, 2, 0)
    ref_sampler.set_epoch(EPOCH)
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in ref][3:]


def test_what_cannot_be_carried_is_refused_in_one_line():
    _, states = _interrupted(48, 2, 3)
    ds = TensorDataset(torch.arange(48))
    cases = [
        (
            DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)),
            "RandomSampler",
        ),
        (
            DataLoader(ds, batch_sampler=BatchSampler(DistributedSampler(ds, 3, 0), 4, False)),
            "its own batch_sampler",
        ),
    ]
    for loader, why in cases:
        with pytest.raises(StateMismatchError, match=why) as err:
            LoaderState.of(loader).load_state_dict(states[0])
        assert "\n" not in str(err.value) and "position from 2 to" in str(err.value)
    loader, _ = _loader(40, 3, 0)
    with pytest.raises(StateMismatchError, match="the dataset has 40 samples, the checkpoint's had 48"):
        LoaderState.of(loader).load_state_dict(states[0])
    assert LoaderState.of(loader).state_dict()["started"] is False  # nothing was loaded
    assert len(list(loader)) == len(loader)
    old = {k: v for k, v in states[0].items() if k not in ("world", "position")}
    loader, _ = _loader(48, 3, 0)
    with pytest.raises(StateMismatchError, match="records no data position"):
        LoaderState.of(loader).load_state_dict(old, world=2)


def test_remainder_indices_is_distributed_sampler_when_nothing_was_consumed():
    ds = TensorDataset(torch.arange(13))
    for world, drop_last in [(2, False), (3, True), (5, False), (20, False)]:
        for rank in range(world):
            s = DistributedSampler(ds, num_replicas=world, rank=rank, seed=SEED, drop_last=drop_last)
            s.set_epoch(EPOCH)
            got = remainder_indices(13, SEED, EPOCH, True, 0, 4, 0, world, rank, drop_last)
            assert got == list(s)
            assert deal(epoch_order(13, SEED, EPOCH, True), world, rank, drop_last) == list(s)


def test_through_the_manager_at_another_world_size(tmp_path, isolated):
    loader, sampler = _loader(48, 2, 0)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        sampler.set_epoch(EPOCH)
        it = iter(loader)
        seen = [next(it)[0].tolist() for _ in range(3)]
        mgr.save(3, blocking=True)
    loader, _ = _loader(48, 3, 0)
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        assert mgr.restore() == 3
        assert (
            mgr.registered("data").describe_reshard().startswith("data position carried: epoch 2, 24 of 48")
        )
    order = epoch_order(48, SEED, EPOCH, True)
    assert seen[0] == order[0:8:2]
    assert [i for b in loader for i in b[0].tolist()] == order[24::3]


def test_a_stateful_dataloader_is_not_loaded_at_another_world_size():
    class Fake:
        loaded = None

        def load_state_dict(self, state):
            self.loaded = state

    f = Fake()
    assert load_stateful_loader(f, {"x": 1}, saved_world=2, world=2) is None and f.loaded == {"x": 1}
    f = Fake()
    line = load_stateful_loader(f, {"x": 1}, saved_world=2, world=3)
    assert f.loaded is None and "not loaded" in line and "first batch" in line


def test_an_unbatched_loader_without_shuffling():
    ds = TensorDataset(torch.arange(30))
    seen, states = [], []
    for rank in range(2):
        loader = DataLoader(ds, batch_size=None, sampler=DistributedSampler(ds, 2, rank, shuffle=False))
        tracker = LoaderState.of(loader)
        it = iter(loader)
        seen += [int(next(it)[0]) for _ in range(6)]
        states.append(tracker.state_dict())
    rest = []
    for rank in range(3):
        loader = DataLoader(ds, batch_size=None, sampler=DistributedSampler(ds, 3, rank, shuffle=False))
        LoaderState.of(loader).load_state_dict(states[rank % 2])
        rest.append([int(x[0]) for x in loader])
    assert rest == [list(range(12, 30))[r::3] for r in range(3)]
    assert sorted(seen + [i for r in rest for i in r]) == list(range(30))
