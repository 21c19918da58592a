"""A save that fails in the background — a real full filesystem, a real read-only mount — leaves
training running, earlier checkpoints intact and the failure visible (issue 3, item 6)."""

from __future__ import annotations

import subprocess

import pytest
import torch

import smartckpt_cli as sc


def _mount(args: list[str]) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip()}); these faults need a real small filesystem")


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)])
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def bind_dir(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    _mount(["--bind", str(src), str(mnt)])
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Linear(512, 128))


def _step(model, opt):
    model(torch.randn(8, 128)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_disk_full_keeps_training_and_the_previous_checkpoint(tiny_fs):
    model = _model()  # ~330 KB of weights: fits once in 3 MB, not with AdamW moments many times
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(tiny_fs, keep_last=3, compression_level=-1, every_steps=1)
    mgr.register(model=model)
    _step(model, opt)
    assert mgr.save(1, blocking=True).wait() is not None
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.register(optimizer=opt)  # now each checkpoint is ~1 MB more than the disk has left
    failed_at = None
    for step in range(2, 12):
        _step(model, opt)  # training goes on whatever the saves do
        res = mgr.step(step)
        if res.handle is not None:
            res.handle.wait()
        if mgr.failures:
            failed_at = step
            break
    assert failed_at is not None, "the 3 MB filesystem never filled up"
    assert "No space left on device" in mgr.failures[0] or "ENOSPC" in mgr.failures[0]
    _step(model, opt)
    assert mgr.step(failed_at + 1).failures >= 1
    failures = mgr.close()
    assert failures
    assert not list(tiny_fs.rglob("*.tmp.*")), "a failed save left temporary files behind"
    # The newest committed checkpoint restores; step 1 at worst, intact.
    fresh = _model()
    with sc.CheckpointManager(tiny_fs) as again:
        again.register(model=fresh)
        step = again.restore()
    assert 1 <= step < failed_at
    if step == 1:
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def test_read_only_directory_keeps_training_and_earlier_checkpoints(bind_dir, tmp_path):
    # The blob directory (node-local disk) goes read-only; the journal lives in meta_dir.
    meta = tmp_path / "meta"
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(bind_dir, meta_dir=meta)
    mgr.register(model=model, optimizer=opt)
    _step(model, opt)
    assert mgr.save(1, blocking=True).wait() is not None
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _mount(["-o", "remount,bind,ro", str(bind_dir)])
    _step(model, opt)
    handle = mgr.save(2)
    assert handle.wait() is None
    assert "Read-only file system" in str(handle.error)
    _step(model, opt)  # training goes on
    failures = mgr.close()
    assert len(failures) == 1 and "step 2" in failures[0]
    # Restoring only reads: it works while the directory is still read-only.
    fresh = _model()
    with sc.CheckpointManager(bind_dir, meta_dir=meta) as again:
        again.register(model=fresh)
        assert again.restore() == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
