"""One commit path (store/commit.py): every writer of checkpoints makes them exist through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from smartckpt_cli.store.commit import CommitLine, adopt, commit, replicated, write_manifest
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.journal import manifest_rel

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "smartckpt_cli"


def test_no_module_but_the_commit_path_writes_a_commit_line():
    """A ``"event": "commit"`` literal (a commit line being built) or a manifest encoded for
    writing appears in store/commit.py alone; the journal only reads them."""
    builds = re.compile(r"""["']event["']\s*:\s*["']commit["']|encode_manifest\(""")
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("store/commit.py", "store/journal.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if builds.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "commit lines or manifests written outside store/commit.py:\n" + "\n".join(found)


def test_a_line_reads_back_as_itself_with_every_field():
    line = CommitLine(
        step=7,
        id="0123456789ab",
        manifest="manifests/00000007-0123456789ab.r0.json",
        manifest_hash="ab" * 16,
        health="nonfinite-loss",
        calm=False,
        reason="preemption (SIGTERM)",
        score=0.5,
        bytes_new=10,
        bytes_total=20,
        lineage="cd" * 6,
        world_size=2,
        parts=(("a.r0.json", "h0", "disk"), ("a.r1.json", "h1")),
        repaired=True,
    )
    assert CommitLine.of(line.event()) == line
    with pytest.raises(ValueError):
        CommitLine.of({"event": "prune", "step": 7})


def test_the_manifest_first_then_the_line_and_a_copy_adopted_as_it_is(tmp_path):
    store = open_store(tmp_path / "a", create=True)
    store_id = store.ensure_journal(None)
    rel = manifest_rel(3, "0123456789ab")
    data, mhash = write_manifest(store.storage, rel, {"format": "smartckpt-manifest", "store_id": store_id})
    assert (tmp_path / "a" / rel).read_bytes() == data
    event = commit(store.journal, CommitLine(step=3, id="0123456789ab", manifest=rel, manifest_hash=mhash))
    (rec,) = store.journal.read().records
    assert (rec.step, rec.manifest, rec.manifest_hash) == (3, rel, mhash)
    newer = {**event, "from_a_newer_writer": 1}
    assert replicated(newer) == newer  # a replica's line is the same line, fields kept
    with pytest.raises(ValueError):
        adopt(store.journal, {"event": "rollback", "to_step": 1})
    assert len(store.journal.read().records) == 1
