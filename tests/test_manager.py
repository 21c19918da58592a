from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import smartckpt_cli as sc
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.storage import LocalStorage


def _model(seed=0, width=256):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))


def _train(model, opt, steps=1):
    for _ in range(steps):
        model(torch.randn(16, model[0].in_features)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _blob_bytes(d) -> int:
    return sum(f.stat().st_size for f in (d / "blobs").rglob("*") if f.is_file())


def test_frozen_weights_are_not_written_again(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with sc.CheckpointManager(tmp_path, chunk_mb=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train(model, opt)
        first = mgr.save(1, blocking=True).wait()
        _train(model, opt)
        second = mgr.save(2, blocking=True).wait()
    assert first is not None and second is not None
    trainable = sum(p.numel() * 4 for p in model[2].parameters()) * 3  # weights + two moments
    assert second.bytes_new <= 1.05 * trainable + 64 * 1024  # + RNG state and small entries
    assert first.bytes_new > 4 * trainable  # the frozen layers were written the first time


def test_retention_keeps_last_n_and_collects_garbage(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with sc.CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 6):
            _train(model, opt)
            mgr.save(step, blocking=True)
    state = Journal(LocalStorage(tmp_path), tmp_path).read()
    assert [r.step for r in state.live()] == [4, 5]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "manifests").iterdir()) == [
        "000000000004",
        "000000000005",
    ]
    # Every remaining blob is referenced by one of the two remaining manifests.
    from smartckpt_cli.store.gc import read_kept

    referenced = set().union(*(read_kept(LocalStorage(tmp_path), r.manifest) for r in state.live()))
    on_disk = {f.name for f in (tmp_path / "blobs").rglob("*") if f.is_file()}
    assert on_disk == referenced


def test_second_writer_is_refused_by_the_lock(tmp_path):
    with (
        sc.CheckpointManager(tmp_path),
        pytest.raises(sc.StoreLockedError, match="already being written by pid"),
    ):
        sc.CheckpointManager(tmp_path)
    sc.CheckpointManager(tmp_path).close()  # released on close


def test_inflight_skip_policy_records_skipped_steps(tmp_path):
    model = _model(width=2048)
    opt = torch.optim.AdamW(model.parameters())
    with sc.CheckpointManager(tmp_path, every_steps=1, inflight="skip", compression_level=19) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train(model, opt)
        results = [mgr.step(s) for s in range(1, 4)]
        assert results[0].saved
        # zstd level 19 on ~1.5 MB keeps the first save busy while the next steps arrive.
        assert mgr.skipped, "no step was skipped"
        assert all(not r.saved for r in results if r.handle is None)


def test_l4_rule_is_not_stored_and_reset_on_restore(tmp_path):
    class Stats:
        def __init__(self):
            self.hist = torch.zeros(100)

        def state_dict(self):
            return {"hist": self.hist}

        def load_state_dict(self, sd):
            self.hist.copy_(sd["hist"])

    stats = Stats()
    stats.hist += 5
    rules = [{"match": "stats/*", "tier": "L4"}]
    with sc.CheckpointManager(tmp_path, tiers=rules) as mgr:
        mgr.register(stats=stats)
        mgr.save(1, blocking=True)
    manifest = next((tmp_path / "manifests").iterdir()).read_text()
    assert "stats/hist" in manifest and '"not_stored":["stats/hist"]' in manifest
    fresh = Stats()
    with sc.CheckpointManager(tmp_path, tiers=rules) as mgr:
        mgr.register(stats=fresh)
        assert mgr.restore() == 1
    assert torch.equal(fresh.hist, torch.zeros(100))


def test_meta_dir_split_keeps_journal_apart_from_blobs(tmp_path):
    data, meta = tmp_path / "nvme", tmp_path / "shared"
    model = _model()
    with sc.CheckpointManager(data, meta_dir=meta) as mgr:
        mgr.register(model=model)
        mgr.save(3, blocking=True)
    assert (meta / "journal.jsonl").exists() and not (data / "journal.jsonl").exists()
    assert (data / "blobs").is_dir() and (data / "manifests").is_dir()
    other = _model(seed=1)
    with sc.CheckpointManager(data, meta_dir=meta) as mgr:
        mgr.register(model=other)
        assert mgr.restore() == 3
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )


def test_background_failure_keeps_training_and_is_reported(tmp_path, caplog):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(tmp_path, every_steps=1)
    mgr.register(model=model, optimizer=opt)
    _train(model, opt)
    assert mgr.save(1, blocking=True).wait() is not None
    # A real filesystem error: the manifests directory is replaced by a file.
    shutil.rmtree(tmp_path / "manifests")
    (tmp_path / "manifests").write_text("in the way")
    with caplog.at_level(logging.ERROR):
        handle = mgr.save(2)
        assert handle.wait() is None and handle.error is not None
        _train(model, opt)  # training goes on
        res = mgr.step(3)
    assert res.failures >= 1 and "save of step 2 failed" in res.last_error
    os.remove(tmp_path / "manifests")
    failures = mgr.close()
    assert failures and "step 2" in failures[0]
    state = Journal(LocalStorage(tmp_path), tmp_path).read()
    assert any(f["step"] == 2 for f in state.failures)
    assert 1 in [r.step for r in state.live()]


def test_dataloader_resumes_at_the_exact_next_batch(tmp_path):
    def make():
        ds = TensorDataset(torch.arange(40).float())
        return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))

    ref_loader = make()
    reference = [b[0].tolist() for _ in range(3) for b in ref_loader]  # 3 epochs of 10 batches

    loader = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=loader)
        seen = [b[0].tolist() for b in loader]  # a whole epoch, to StopIteration
        it = iter(loader)
        for _ in range(3):
            seen.append(next(it)[0].tolist())
        mgr.save(13, blocking=True)
    assert seen == reference[:13]

    resumed = make()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(data=resumed)
        assert mgr.restore() == 13
        assert len(resumed) == 10  # len() does not consume the pending skip
        rest = [b[0].tolist() for b in resumed]
        rest += [b[0].tolist() for b in resumed]
    assert rest == reference[13:]
