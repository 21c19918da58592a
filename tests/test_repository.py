"""One repository format over any backend: the journal's two layouts (a file of lines where the
backend appends, one object per event on an object store or a replica), chosen from what the
repository holds; a store opened by URL reads as the same store opened by directory. Real files
and fsspec's in-memory object store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from smartckpt_cli import CheckpointManager
from smartckpt_cli.errors import NotAStoreError
from smartckpt_cli.ops.verify import verify
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.log import JOURNAL, JOURNAL_DIR
from smartckpt_cli.store.storage import LocalStorage, open_storage
from tests._names import commit

pytest.importorskip("fsspec")


def _memory_url() -> str:
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/prefix"


def test_an_object_store_journal_is_one_object_per_event_and_replays_like_lines(tmp_path: Path) -> None:
    objects = open_storage(_memory_url())
    lines = LocalStorage(tmp_path)
    assert (objects.appends, lines.appends) == (False, True)
    states = []
    for storage in (objects, lines):
        j = Journal(storage)
        assert not j.exists()
        sid = j.create("ab" * 16)
        for step in (10, 20):
            j.append(commit(step))
        j.append({"event": "prune", "ids": [commit(10)["id"]], "steps": [10], "why": "test"})
        states.append(Journal(storage).read())  # a new reader finds the layout from what is there
        assert sid == states[-1].store_id
    on_objects, on_lines = states
    assert [(r.step, r.pruned) for r in on_objects.records] == [(r.step, r.pruned) for r in on_lines.records]
    assert [(r.step, r.pruned) for r in on_lines.records] == [(10, True), (20, False)]
    assert len(objects.list(JOURNAL_DIR)) == 4 and not objects.exists(JOURNAL)
    assert lines.exists(JOURNAL) and not lines.list(JOURNAL_DIR)
    assert on_objects.next_seq == 4


def test_a_directory_holding_journal_objects_is_read_as_objects(tmp_path: Path) -> None:
    # a file:// replica: a directory, but written by the replicator in the objects layout
    j = Journal(LocalStorage(tmp_path), layout="objects")
    j.create("cd" * 16)
    j.append(commit(5), seq=1, tag=commit(5)["id"])
    again = Journal(LocalStorage(tmp_path))  # no layout given: it reads what is there
    assert again.layout == "objects" and [r.step for r in again.read().live()] == [5]
    assert not (tmp_path / JOURNAL).exists()


def test_an_object_store_refuses_append_in_one_line() -> None:
    storage = open_storage(_memory_url())
    with pytest.raises(OSError, match="no append"):
        storage.append(JOURNAL, b"x\n")


def test_a_store_opened_by_file_url_is_the_store_opened_by_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    with CheckpointManager(tmp_path / "ck", keep_last=3) as mgr:
        mgr.register(model=model)
        for step in (1, 2):
            mgr.save(step, blocking=True)
    by_dir, by_url = open_store(tmp_path / "ck"), open_store(f"file://{tmp_path / 'ck'}")
    assert by_url.url == f"file://{tmp_path / 'ck'}" and by_url.journal.layout == "lines"
    assert [r.id for r in by_url.journal.read().live()] == [r.id for r in by_dir.journal.read().live()]
    report = verify(by_url, all_checkpoints=True)
    assert report.ok and [r.step for r in report.results] == [2, 1]
    with pytest.raises(NotAStoreError, match="no journal"):
        open_store(f"file://{tmp_path / 'empty'}")


def test_leases_keep_a_prune_and_an_upload_apart_and_a_dead_writers_expires() -> None:
    import json
    import time

    from smartckpt_cli.store.leases import LEASES_DIR, STALE_AFTER, LeaseHeld, holding, others, take

    storage = open_storage(_memory_url())
    upload = take(storage, "upload")
    with pytest.raises(LeaseHeld, match="upload by pid"), holding(storage, "prune", {"upload", "prune"}):
        raise AssertionError("a prune ran beside an upload")
    assert [lease.rel for lease in others(storage)] == [upload.rel]  # the refused prune's lease is gone
    with holding(storage, "upload", {"prune"}):  # uploads do not exclude each other
        assert len(others(storage)) == 2
    # a lease not renewed for STALE_AFTER seconds is a dead writer's
    storage.write(
        upload.rel, json.dumps({"kind": "upload", "who": "x", "utc": time.time() - STALE_AFTER - 1}).encode()
    )
    with holding(storage, "prune", {"upload", "prune"}) as mine:
        assert mine.kind == "prune"
    # one that cannot be read counts as live; a name that is not a lease's is never read
    storage.write(upload.rel, b"not json")
    storage.write(f"{LEASES_DIR}/somebody-else.txt", b"x")
    with pytest.raises(LeaseHeld, match="unreadable"), holding(storage, "prune", {"upload"}):
        pass
    # renewal rewrites the time only when due
    assert upload.renewed(storage, now=upload.utc + 1) is upload
    fresh = upload.renewed(storage, now=upload.utc + STALE_AFTER / 2)
    assert (
        fresh.utc == upload.utc + STALE_AFTER / 2 and json.loads(storage.read(upload.rel))["utc"] == fresh.utc
    )


def test_a_url_that_cannot_be_read_is_one_line_with_its_exit_code(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("s3fs")
    from tests._s3 import free_port

    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens: the remote is down
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for cmd, code, words in [
        (["verify", "s3://b/run"], 1, "s3://b/run cannot be read: "),
        (["inspect", "s3://b/run"], 1, "s3://b/run cannot be read: "),
        (["prune", "s3://b/run", "--keep", "1"], 1, "remote s3://b/run unreachable: "),
        (["verify", "nosuch://b/run"], 2, "no fsspec backend for 'nosuch://'"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "smartckpt_cli.cli.app", *cmd],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == code, (cmd, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and words in out.stderr, (cmd, out.stderr)
