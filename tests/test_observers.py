"""engine/observers.py: the remote tier seen through the engine's two protocols, and a real
manager telling it of its start, commits and close."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.config import load_settings
from smartckpt_cli.engine.observers import CheckpointSource, CommitObserver, LocalSource, open_tiers
from smartckpt_cli.remote.replica import open_remote, replica_journal
from smartckpt_cli.remote.tier import RemoteTier
from smartckpt_cli.store.directory import open_store

pytestmark = pytest.mark.usefixtures("isolated")


def test_without_remote_restores_look_locally_and_nobody_listens(tmp_path: Path) -> None:
    settings, _ = load_settings(None, {"dir": str(tmp_path)})
    source, observers = open_tiers(settings, open_store(tmp_path, create=True))
    assert isinstance(source, LocalSource) and source.adopted_store_id is None
    assert observers == []


def test_the_remote_tier_meets_both_protocols_structurally(tmp_path: Path) -> None:
    settings, _ = load_settings(None, {"dir": str(tmp_path / "ckpt"), "remote": f"file://{tmp_path / 'r'}"})
    source, observers = open_tiers(settings, open_store(tmp_path / "ckpt", create=True))
    assert isinstance(source, RemoteTier) and observers == [source]
    assert isinstance(source, CheckpointSource) and isinstance(source, CommitObserver)
    assert not isinstance(LocalSource(), CommitObserver)


def test_manager_tells_the_remote_tier_of_its_commits(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    model = torch.nn.Linear(4, 2)
    with sc.CheckpointManager(tmp_path / "ckpt", remote=url) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True)
        mgr.save(2, blocking=True)
    # close() (on_close) drained the uploader that on_start started and on_commit woke
    state = replica_journal(open_remote(url)).read()
    assert sorted(r.step for r in state.records if r.live) == [1, 2]
    assert state.store_id == mgr.store_id


class Recorder:
    """A commit observer that writes down what it hears; ``fail`` makes on_commit raise."""

    def __init__(self, fail: bool = False) -> None:
        self.heard: list[object] = []
        self.fail = fail

    def on_start(self, store_id: str) -> None:
        self.heard.append(("start", store_id))

    def on_commit(self, info: object) -> None:
        self.heard.append(("commit", info.step))  # type: ignore[attr-defined]
        if self.fail:
            raise RuntimeError("observer broke")

    def on_preempt(self) -> None:
        self.heard.append("preempt")

    def on_close(self) -> None:
        self.heard.append("close")


def test_observers_hear_each_commit_and_cannot_undo_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    good, bad = Recorder(), Recorder(fail=True)
    assert isinstance(good, CommitObserver)
    mgr = sc.CheckpointManager(tmp_path / "ckpt")
    mgr._observers += [bad, good]  # the manager builds its own list (open_tiers); these join it
    mgr.register(model=model)
    first = mgr.save(1, blocking=True)
    second = mgr.save(2, blocking=True)
    assert mgr.close() == []
    assert first.error is None and second.error is None, "an observer's failure failed the save"
    assert good.heard == [("commit", 1), ("commit", 2), "close"]
    assert bad.heard == [("commit", 1), ("commit", 2), "close"]
    state = open_store(tmp_path / "ckpt").journal.read()
    assert [r.step for r in state.records] == [1, 2]
