"""Scrubbing reused blobs (store/scrub.py): a bit flipped in a blob that later checkpoints keep
reusing (frozen weights) is found by a save, written again from the live tensor, reported, and
every checkpoint that references it verifies again. Real files, a real flipped bit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from typer.testing import CliRunner

import smartckpt_cli as sc
from smartckpt_cli.cli.app import app
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.scrub import Scrubber, ScrubBook


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    for p in model[0].parameters():  # frozen: every checkpoint reuses its blobs
        p.requires_grad_(False)
    return model


def _frozen_blob(store: Path) -> str:
    st = open_store(store)
    state = st.journal.read()
    rec = state.live()[-1]
    manifest = json.loads((store / rec.manifest).read_bytes())
    return manifest["entries"]["model/0.weight"]["data"]["chunks"][0][0]


def test_a_bit_flip_in_a_shared_blob_is_found_and_rewritten_by_a_save(tmp_path: Path, caplog) -> None:
    store = tmp_path / "store"
    model = _model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mgr = sc.CheckpointManager(store, keep_last=20, every_steps=1)
    mgr.register(model=model, optimizer=opt)
    found_at = None
    with caplog.at_level(logging.WARNING, logger="smartckpt_cli.engine.saving"):
        for step in range(1, 13):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 4:  # bit rot in the frozen weight's blob, referenced by steps 1..3 already
                bid = _frozen_blob(store)
                path = store / "blobs" / bid[:2] / bid
                raw = bytearray(path.read_bytes())
                raw[len(raw) // 2] ^= 0x10
                path.write_bytes(bytes(raw))
                flipped_at = step
            res = mgr.step(step)
            assert res.handle is not None and res.handle.wait() is not None
            if found_at is None and step >= 4 and any("bit rot" in r.getMessage() for r in caplog.records):
                found_at = step
    assert mgr.close() == []
    assert found_at is not None and found_at - flipped_at <= 2, (flipped_at, found_at)
    _, events = open_store(store).journal.read_events()
    repaired = [e for e in events if e["event"] == "blob_repaired"]
    assert [e["blobs"] for e in repaired] == [[bid]] and repaired[0]["step"] == found_at
    # The file holds the right bytes again: every checkpoint, the older ones too, verifies.
    listed = json.loads(CliRunner().invoke(app, ["inspect", str(store), "--json"]).stdout)["checkpoints"]
    assert all(r["blobs_checked_utc"] for r in listed)  # inspect: the oldest check of its blobs
    assert {r["blobs_checked_how"] for r in listed} <= {"checked", "written"}
    done = CliRunner().invoke(app, ["verify", str(store), "--all"])
    assert done.exit_code == 0, done.output
    assert done.output.count(" ok") >= 12, done.output
    listed = json.loads(CliRunner().invoke(app, ["inspect", str(store), "--json"]).stdout)["checkpoints"]
    assert {r["blobs_checked_how"] for r in listed} == {"checked"}  # verify re-hashed every blob


def test_scrubbing_is_bounded_and_rotates_through_every_reused_blob(tmp_path: Path) -> None:
    book = ScrubBook(open_store(tmp_path, create=True).meta)
    scrub = Scrubber(book, min_bytes=100)
    blobs = [f"{i:032x}" for i in range(10)]
    seen: list[list[str]] = []
    for _ in range(12):
        scrub.begin_save(last_bytes_new=0)
        picked = [b for b in blobs if scrub.wants(b, 40)]  # 40 bytes each, 100 a save: 3 a save
        for b in picked:
            scrub.checked(b, True)
        scrub.end_save()
        seen.append(picked)
    assert all(len(p) <= 3 for p in seen)  # the budget: never more than the bytes allowed
    assert {b for p in seen[:4] for b in p} == set(blobs)  # one rotation covers every blob
    assert set(ScrubBook(book.meta).checked) == set(blobs)  # and the book remembers when
