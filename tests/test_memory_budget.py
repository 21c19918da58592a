"""``memory_budget``: a save never holds more host memory than it allows (issue 42, item 2).

Above one copy of the state the RAM tier keeps a second slot when two fit; below it the RAM
tier stands down and every save copies and writes the state a piece at a time through one
reusable buffer, the training loop waiting for the copies. The checkpoints are the same bytes
(the same chunks, the same blobs) an unbudgeted save writes, and restore exactly.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.engine.budget import encoder_reserve, encoding_for, plan_staging
from smartckpt_cli.engine.restore import load_checkpoint
from smartckpt_cli.state.tree import flatten
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.directory import open_store

MB = 1 << 20
# One encoder thread and 1 MiB chunks: the encoders' share of a budget is 3 MiB, and a budget of
# a few MiB cuts the state below (two 8 MiB weights and their moments) into several pieces.
SMALL = {"workers": 1, "chunk_mb": 1}


# ---------------------------------------------------------------- the decision


@pytest.mark.parametrize(
    ("budget", "slots", "want_slots", "want_piece", "said"),
    [
        (None, 0, 1, None, None),  # no budget: one copy, one slot
        (None, 2, 2, None, None),  # no budget: as asked
        (400, 0, 2, None, None),  # two copies fit: a second slot
        (180, 0, 1, None, None),  # one fits
        (180, 2, 1, None, "ram_slots 2 needs"),  # two asked for, one fits: said
        (180, 1, 1, None, None),
        (70, 0, 0, 60, "in pieces of"),  # not one: pieces of what is left, the RAM tier down
        (12, 0, 0, 16, "in pieces of"),  # never below one chunk
    ],
)
def test_the_budget_decides_slots_and_pieces(budget, slots, want_slots, want_piece, said):
    plan = plan_staging(100, budget=budget, reserve=10, chunk=16, ram=True, slots=slots)
    assert (plan.slots, plan.piece) == (want_slots, want_piece)
    assert (plan.line is None) if said is None else (said in plan.line)
    if want_piece is not None:
        assert "RAM tier stands down" in plan.line
        no_ram = plan_staging(100, budget=budget, reserve=10, chunk=16, ram=False, slots=slots)
        assert "RAM tier" not in no_ram.line


def test_the_encoders_share_is_three_chunks_per_thread():
    assert encoder_reserve(4, 16 * MB) == 192 * MB


@pytest.mark.parametrize(
    ("state", "workers", "want"),
    [
        (12 * 10**9, 4, (16 * MB, 4)),  # a 7B state's share of a rank: the chunks as set
        (int(1.21e9), 4, (8 * MB, 4)),  # 96 MiB of scratch: within a tenth of the state
        (int(0.30e9), 4, (2 * MB, 4)),  # within 32 MiB
        (6_300_000, 4, (2 * MB, 4)),  # a small state keeps its threads (32 MiB is nothing)
        (6_300_000, 16, (1 * MB, 10)),  # ... unless there are so many of them
    ],
)
def test_the_encoders_scratch_follows_the_state(state, workers, want):
    chunk, n = encoding_for(state, chunk=16 * MB, workers=workers)
    assert (chunk, n) == want
    assert encoder_reserve(n, chunk) <= max(state / 10, 32 * MB)


# ---------------------------------------------------------------- saves in pieces


def _model(seed=0):
    torch.manual_seed(seed)
    # 2 x 8 MiB weights (each cut over several pieces), a BatchNorm whose buffers the forward
    # changes (copied before the save call returns), and AdamW's moments (guarded by the step)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 4096), torch.nn.BatchNorm1d(4096), torch.nn.Linear(4096, 512)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    model.train()
    model(torch.randn(32, 512, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the state by its checkpoint key, cloned."""
    out = {}
    for name, obj in (("model", model), ("optimizer", opt)):
        out.update({k: v.clone() for k, v in flatten(obj.state_dict(), name)[1].items()})
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert want.keys() <= got.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _loaded(store: Path, step: int) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint of ``step``, read back and verified."""
    st = open_store(store)
    state = st.journal.read()
    (rec,) = [r for r in state.live() if r.step == step]
    return load_checkpoint(st.storage, st.blobs, rec, state.store_id).tensors


def _restore(store: Path, step: int) -> dict[str, torch.Tensor]:
    """Restored into a fresh model and optimizer through the API (the newest checkpoint)."""
    model, opt = _model(seed=1)
    with sc.CheckpointManager(store) as mgr:
        mgr.register(model=model, optimizer=opt)
        assert mgr.restore() == step
    return _state(model, opt)


def _chunks(store: Path, step: int) -> dict[str, list]:
    journal = [json.loads(ln) for ln in (store / "journal.jsonl").read_text().splitlines()]
    rel = next(e["manifest"] for e in journal if e.get("event") == "commit" and e["step"] == step)
    manifest = json.loads((store / rel).read_text())
    return {k: [c[0] for c in e["data"]["chunks"]] for k, e in manifest["entries"].items()}


def test_a_state_above_the_budget_is_saved_in_pieces_and_restores_exactly(tmp_path, caplog):
    model, opt = _model()
    expected = {}
    budgeted = sc.CheckpointManager(tmp_path / "st", every_steps=2, keep_last=4, memory_budget="8M", **SMALL)
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli"), budgeted as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 9):
            _train_step(model, opt, step)
            res = mgr.step(step)
            if res.saved:
                expected[step] = _state(model, opt)
                assert res.handle is not None and res.handle.lazy  # the optimizer step waits
                assert res.handle.wait() is not None, mgr.failures
    said = [r.getMessage() for r in caplog.records if "memory_budget" in r.getMessage()]
    assert len(said) == 1 and "in pieces of 5.2 MB" in said[0], said
    assert sorted(expected) == [2, 4, 6, 8]
    for step, state in expected.items():
        _assert_equal(_loaded(tmp_path / "st", step), state)
    _assert_equal(_restore(tmp_path / "st", 8), expected[8])
    # the same chunks (so the same blobs) as a save of the same state in one go
    model2, opt2 = _model(seed=2)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    with sc.CheckpointManager(tmp_path / "whole", **SMALL) as mgr:
        mgr.register(model=model2, optimizer=opt2)
        assert mgr.save(8, blocking=True).wait() is not None
    pieces, whole = _chunks(tmp_path / "st", 8), _chunks(tmp_path / "whole", 8)
    pieces.pop("rng/torch"), whole.pop("rng/torch")  # the generator moved on in between
    assert pieces == whole
    assert len(whole["model/0.weight"]) == 8  # 8 MiB in 1 MiB chunks, cut over two pieces


def test_an_explicit_save_in_pieces_returns_once_everything_is_copied(tmp_path):
    model, opt = _model()
    with sc.CheckpointManager(tmp_path, memory_budget="8M", **SMALL) as mgr:
        mgr.register(model=model, optimizer=opt)
        _train_step(model, opt, 1)
        expected = _state(model, opt)
        handle = mgr.save(1)
        assert not handle.lazy
        with torch.no_grad():  # the moment save() returns the state is the caller's again
            for p in model.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                s["exp_avg"].add_(1.0)
        assert handle.wait() is not None, mgr.failures
    _assert_equal(_restore(tmp_path, 1), expected)


def test_a_save_in_pieces_that_fails_leaves_training_running(tmp_path):
    """A real full filesystem in the middle of a save in pieces: the failure is recorded, the
    optimizer step never waits forever, and a save once there is room commits."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip()}); this needs a real small filesystem")
    try:
        model, opt = _model()
        ballast = mnt / "ballast"
        ballast.write_bytes(b"\0" * (76 * MB))  # 20 MB left: the 50 MB state (raw) cannot fit
        with sc.CheckpointManager(
            mnt / "st", every_steps=1, memory_budget="8M", compression_level=-1, **SMALL
        ) as mgr:
            mgr.register(model=model, optimizer=opt)
            _train_step(model, opt, 1)
            res = mgr.step(1)
            assert res.saved and res.handle is not None
            _train_step(model, opt, 2)  # the guarded optimizer step: released by the failure
            assert res.handle.wait() is None and mgr.failures
            assert "No space left on device" in mgr.failures[0], mgr.failures
            ballast.unlink()
            expected = _state(model, opt)
            assert mgr.save(2, blocking=True).wait() is not None, mgr.failures
        _assert_equal(_restore(mnt / "st", 2), expected)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------- the RAM tier's slots


@pytest.mark.parametrize(("budget", "slots"), [("200M", ["slot0", "slot1"]), ("60M", ["slot0"]), ("8M", [])])
def test_the_budget_gives_the_ram_tier_two_slots_one_or_none(
    tmp_path, area, monkeypatch, caplog, budget, slots
):
    """The state is 50 MiB: 200M holds two slots, 60M one, 8M not one (the tier stands down, one
    line, the disk saves go on in pieces and restore exactly)."""
    monkeypatch.setenv(ramarea.ENV_AREA, str(area))
    model, opt = _model()
    budgeted = sc.CheckpointManager(
        tmp_path / "st", every_steps=4, ram_every=0.01, memory_budget=budget, **SMALL
    )
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli"), budgeted as mgr:
        mgr.register(model=model, optimizer=opt)
        for step in range(1, 9):
            _train_step(model, opt, step)
            mgr.step(step)
            mgr.wait()
        expected = _state(model, opt)
    rank = area / "rank0"
    have = sorted(p.name for p in rank.iterdir() if p.name.startswith("slot")) if rank.is_dir() else []
    assert have == slots
    said = [r.getMessage() for r in caplog.records if "RAM tier stands down" in r.getMessage()]
    assert len(said) == (0 if slots else 1), said
    if slots:
        assert ramarea.read_record(rank)["step"] == 8  # the RAM snapshots were taken
    _assert_equal(_restore(tmp_path / "st", 8), expected)
