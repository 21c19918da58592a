from __future__ import annotations

import pytest

from smartckpt_cli.errors import JournalError
from smartckpt_cli.store.journal import Journal, decode_line, encode_line, fold
from smartckpt_cli.store.storage import LocalStorage
from tests._names import cid, commit


def _journal(tmp_path) -> Journal:
    j = Journal(LocalStorage(tmp_path), tmp_path)
    j.create()
    return j


def _commit(j: Journal, step: int, ident: str | None = None) -> None:
    j.append(commit(step, ident))


def test_line_checksum_detects_any_change():
    line = encode_line({"event": "commit", "step": 5})
    assert decode_line(line.strip()) == {"event": "commit", "step": 5}
    assert decode_line(line.replace(b'"step":5', b'"step":6')) is None
    assert decode_line(b"not json") is None


def test_torn_last_line_is_skipped_and_next_append_starts_fresh(tmp_path, caplog):
    j = _journal(tmp_path)
    _commit(j, 10)
    half = encode_line(commit(20))
    with open(j.path, "ab") as f:
        f.write(half[: len(half) // 2])
    state = j.read()
    assert [r.step for r in state.records] == [10]
    assert any("torn last line" in p for p in state.problems)
    assert "torn last line" in caplog.text
    _commit(j, 30)  # the writer cuts the torn tail off first: it never committed anything
    state = j.read()
    assert [r.step for r in state.records] == [10, 30]
    assert state.problems == []
    assert "removed a torn last line" in caplog.text


def test_damage_in_the_middle_is_reported_not_removed(tmp_path):
    j = _journal(tmp_path)
    for step in (1, 2, 3):
        _commit(j, step)
    raw = j.path.read_bytes().split(b"\n")
    raw[2] = raw[2].replace(b'"step":2', b'"step":7')  # a bit flip in a complete line
    j.path.write_bytes(b"\n".join(raw))
    _commit(j, 4)
    state = j.read()
    assert [r.step for r in state.records] == [1, 3, 4]
    assert state.problems == [f"{j.path} line 3: damaged line, skipped"]


def test_fold_rollback_undo_and_prune():
    evs = [{"event": "init", "store_id": "5" * 32}]
    evs += [commit(s) for s in (1, 2, 3)]
    evs.append({"event": "rollback", "to_step": 1})
    evs.append(commit(2, cid("c2b")))
    _, recs, _ = fold(evs)
    assert [(r.id, r.rolled_back) for r in recs] == [
        (cid(1), False),
        (cid(2), True),
        (cid(3), True),
        (cid("c2b"), False),
    ]
    _, recs, _ = fold([*evs, {"event": "rollback", "undo": True}])
    assert not any(r.rolled_back for r in recs)
    _, recs, _ = fold([*evs, {"event": "prune", "ids": [cid(1)]}])
    assert recs[0].pruned and not recs[0].live


def test_unknown_version_and_foreign_files_are_refused(tmp_path):
    (tmp_path / "journal.jsonl").write_bytes(
        encode_line({"event": "init", "format": "smartckpt-journal", "v": 99})
    )
    with pytest.raises(JournalError, match="version 99"):
        Journal(LocalStorage(tmp_path), tmp_path).read()
    (tmp_path / "journal.jsonl").write_bytes(b"\x00\x01garbage\n")
    with pytest.raises(JournalError, match="not a smartckpt journal"):
        Journal(LocalStorage(tmp_path), tmp_path).read()
