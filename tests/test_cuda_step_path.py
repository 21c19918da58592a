"""The per-step path on a GPU: the signals' readback never stalls the stream, the staging buffers
are pinned at their exact size, and a manager's evaluations run on CUDA tensors. Skipped where
torch sees no CUDA device (the CPU fallbacks are tested in test_step_path.py)."""

from __future__ import annotations

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.engine.hostmem import host_buffer
from smartckpt_cli.trigger.signals import Signals

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none"),
]


def test_the_readback_waits_for_nothing_until_asked():
    sig = Signals(eval_every=1)
    for x in (1.0, 3.0, 2.0):
        sig.add_loss(torch.tensor(x, device="cuda"))
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the reductions
    sig.launch(1, memory=0.5)
    assert sig.poll() is None  # the event has not passed: no wait, no reading yet
    r = sig.poll(wait=True)
    assert r is not None and r.loss == 2.0 and r.raw_loss == 2.0 and r.memory == 0.5


def test_staging_is_pinned_at_its_exact_size_and_takes_non_blocking_copies():
    shape = torch.Size([3, 1000, 1001])  # 12 MB: PyTorch's pinned allocator would hold 16 MiB
    buf = host_buffer(shape, torch.float32, pin=True)
    assert buf.is_pinned() and buf.shape == shape
    base = getattr(buf, "_smartckpt_base", None)
    assert base is not None and base.numel() < buf.numel() * 4 + 2 * 4096
    src = torch.randn(shape, device="cuda")
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())


def test_a_manager_evaluates_and_saves_cuda_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with sc.CheckpointManager(tmp_path, every_steps=20, eval_every=5) as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 41):
            loss = model(torch.randn(32, 64, device="cuda")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.step(step, loss=loss)
    (trace,) = (tmp_path / "traces").iterdir()
    rows = [ln.split(",") for ln in trace.read_text().splitlines()[1:]]
    assert [int(r[0]) for r in rows] == list(range(5, 41, 5))
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)  # variance and planned update
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    with sc.CheckpointManager(tmp_path) as mgr:
        mgr.register(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-3))
        assert mgr.restore() == 40
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_the_ram_tiers_slot_is_pinned_for_a_state_on_the_gpu(tmp_path, monkeypatch):
    """A state on the GPU: the RAM tier's slot (shared memory) is registered with CUDA, so the
    snapshot's device-to-host copies into it run at pinned speed (issue 42, item 5)."""
    from pathlib import Path

    from smartckpt_cli.store import ramarea

    area = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    area = area / f"smartckpt-test-pinned-{tmp_path.name}"
    area.mkdir()
    monkeypatch.setenv(ramarea.ENV_AREA, str(area))
    model = torch.nn.Linear(256, 256, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    try:
        with sc.CheckpointManager(tmp_path / "st", every_steps=1000, ram_every=1e-3) as mgr:
            mgr.register(model=model, optimizer=opt)
            for step in range(1, 4):
                model(torch.randn(8, 256, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
                mgr.step(step)
                mgr.wait()
            bufs = mgr._ram.buffers[0]
            assert bufs and all(b.is_pinned() for b in bufs.values())
            assert ramarea.read_record(area / "rank0")["step"] == 3
    finally:
        import shutil

        shutil.rmtree(area, ignore_errors=True)
