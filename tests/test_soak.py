"""200 consecutive saves: memory stays flat (staging buffers are reused), no file descriptor or
thread leaks (issue 3, item 5). The figure for the default 100M model comes from
benchmarks/soak.py; this is the same check at a size the test suite can afford."""

from __future__ import annotations

import ctypes
import gc
import threading

import psutil
import pytest
import torch

import smartckpt_cli as sc


def _rss(proc: psutil.Process) -> int:
    """Resident memory with the heap's free pages handed back first: earlier tests in the same
    process leave a fragmented heap whose growth is no leak of ours."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as it is
        pass
    return int(proc.memory_info().rss)


@pytest.mark.slow
def test_two_hundred_saves_keep_memory_fds_and_threads_flat(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.Linear(768, 512))
    opt = torch.optim.AdamW(model.parameters())
    proc = psutil.Process()
    with sc.CheckpointManager(tmp_path, keep_last=2, every_steps=1) as mgr:
        mgr.register(model=model, optimizer=opt)
        staging = None
        for step in range(1, 201):
            model(torch.randn(4, 512)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            res = mgr.step(step)
            assert res.saved and res.failures == 0
            if step == 20:  # warm: buffers allocated, thread pools started, caches filled
                mgr.wait()
                rss0, fds0, threads0 = _rss(proc), proc.num_fds(), threading.active_count()
                staging = mgr._stager.nbytes
        mgr.wait()
        rss1, fds1, threads1 = _rss(proc), proc.num_fds(), threading.active_count()
    assert staging is not None and staging > 5e6
    assert rss1 - rss0 < staging, f"RSS grew by {(rss1 - rss0) / 1e6:.1f} MB over 180 saves"
    assert fds1 == fds0
    assert threads1 == threads0
    live = [p.name for p in (tmp_path / "manifests").iterdir()]
    assert len(live) == 2
