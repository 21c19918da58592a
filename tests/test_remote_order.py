"""The remote tier's deciding code, without a network: restore order, what a round uploads, the
remote journal's names and replay, URLs in logs, the bandwidth cap, settings."""

from __future__ import annotations

import time

import pytest

from smartckpt_cli.config import load_settings
from smartckpt_cli.errors import ConfigError
from smartckpt_cli.remote.check import upload_lag
from smartckpt_cli.remote.fetch import restore_order
from smartckpt_cli.remote.replica import display_url, open_remote, replica_journal
from smartckpt_cli.remote.replicator import plan_round
from smartckpt_cli.store.journal import CheckpointRecord, JournalState
from smartckpt_cli.store.log import JOURNAL_DIR, object_name
from smartckpt_cli.store.names import journal_object
from smartckpt_cli.store.storage import Limiter
from tests._names import HASH, commit
from tests._names import cid as make_cid

STORE = "5" * 32


def rec(step: int, pos: int, cid: str | None = None, **kw: object) -> CheckpointRecord:
    ev = commit(step, make_cid(cid or f"id{step}"))
    return CheckpointRecord(step, ev["id"], ev["manifest"], HASH, pos, event=ev, **kw)  # type: ignore[arg-type]


def test_order_local_first_each_repairable_from_remote():
    local = [rec(30, 3), rec(20, 2), rec(10, 1)]
    remote = [rec(20, 2), rec(10, 1)]
    order = restore_order(local, {r.id for r in local}, remote)
    assert [(c.record.step, c.where, c.remote_copy) for c in order] == [
        (30, "local", False),
        (20, "local", True),
        (10, "local", True),
    ]


def test_order_wiped_node_takes_remote_newest_first():
    remote = [rec(30, 3), rec(20, 2)]
    order = restore_order([], set(), remote)
    assert [(c.record.step, c.where) for c in order] == [(30, "remote"), (20, "remote")]


def test_order_remote_newer_than_local_comes_first_older_last():
    # a new local store (after a wipe) that saved step 5 before noticing; the remote has 40 and 2
    local = [rec(5, 1, "new5")]
    remote = [rec(40, 4), rec(2, 1)]
    order = restore_order(local, {make_cid("new5")}, remote)
    assert [(c.record.step, c.where) for c in order] == [(40, "remote"), (5, "local"), (2, "remote")]


def test_order_never_resurrects_what_the_local_journal_pruned_or_rolled_back():
    local_live = [rec(10, 1)]
    known = {make_cid(f"id{s}") for s in (10, 20, 30)}  # 20 pruned, 30 rolled back locally
    remote = [rec(30, 3), rec(20, 2), rec(10, 1)]
    order = restore_order(local_live, known, remote)
    assert [c.record.step for c in order] == [10]


def test_plan_round_uploads_missing_in_commit_order_and_withdraws_rollbacks():
    local = JournalState(
        STORE,
        [rec(10, 1), rec(20, 2, rolled_back=True), rec(30, 3), rec(40, 4, pruned=True), rec(50, 5)],
        [],
        [],
    )

    remote = JournalState(STORE, [rec(10, 1), rec(20, 2)], [], [], next_seq=3)
    plan = plan_round(local, remote)
    assert [r.step for r in plan.upload] == [30, 50]  # pruned 40 is gone locally: never shipped
    assert [r.step for r in plan.withdraw] == [20]
    assert [r.step for r in plan_round(local, remote, skip={make_cid("id30")}).upload] == [50]


def test_upload_lag_is_live_local_not_remote():
    local = [rec(10, 1), rec(20, 2), rec(30, 3, pruned=True)]
    assert [r.step for r in upload_lag(local, {make_cid("id10")})] == [20]


def parse_name(name):
    obj = journal_object(name)
    return None if obj is None else (obj.seq, obj.event)


def test_object_names_sort_in_sequence_and_parse_back():
    names = [object_name(n, "commit", make_cid(n)) for n in (10, 2, 100)]
    assert sorted(names) == [object_name(n, "commit", make_cid(n)) for n in (2, 10, 100)]
    assert parse_name(object_name(7, "prune", "abcdef012345")) == (7, "prune")
    assert parse_name("junk.json") is None and parse_name("000000000001-commit-x") is None
    # a name that is not the format's is never read: it could name anything
    assert parse_name("000000000001-commit-../../x.json") is None
    assert parse_name(object_name(7, "prune", "abc")) is None


def test_remote_journal_replays_and_skips_a_damaged_object(tmp_path):
    remote = open_remote(f"file://{tmp_path}")
    j = replica_journal(remote)
    j.create(STORE)
    for seq, r in enumerate([rec(10, 1), rec(20, 2)], start=1):
        j.append(dict(r.event), seq=seq, tag=r.id)
    j.append({"event": "prune", "ids": [make_cid("id10")]}, seq=3)
    damaged = tmp_path / JOURNAL_DIR / object_name(4, "commit", "bad0bad0bad0")
    damaged.write_bytes(b'{"event":"commit","step":99,"crc":"0"}\n')
    state = j.read()
    assert state.store_id == STORE
    assert [r.step for r in state.live()] == [20]
    assert state.next_seq == 5
    assert any("damaged" in p for p in state.problems)


def test_display_url_strips_credentials():
    assert display_url("s3://AKIA:verysecret@bucket/p") == "s3://bucket/p"
    shown = display_url("gs://b/p?token=abc&region=eu&X-Amz-Signature=zzz")
    assert "abc" not in shown and "zzz" not in shown and "region=eu" in shown


def test_config_show_never_prints_a_secret_in_the_url():
    from smartckpt_cli.ops.config_report import effective_settings

    rows, _ = effective_settings(None, {"remote": "s3://AKIA:verysecret@bucket/p"}, env={})
    shown = {r.key: r.value for r in rows}
    assert shown["remote"] == "s3://bucket/p"


def test_limiter_caps_the_rate():
    lim = Limiter(1 << 20)  # 1 MiB/s
    t0 = time.monotonic()
    for _ in range(4):
        lim.take(1 << 18)
    assert time.monotonic() - t0 >= 0.9
    t0 = time.monotonic()
    Limiter(0).take(1 << 30)
    assert time.monotonic() - t0 < 0.1


def test_bad_remote_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="remote must be a URL"):
        open_remote("bucket-without-scheme")
    with pytest.raises(ConfigError, match="no fsspec backend"):
        open_remote("nosuchproto://x/y")
    with pytest.raises(ConfigError, match="remote_part_mb"):
        load_settings(None, {"remote_part_mb": 1}, env={})
    s, _ = load_settings(
        None, {}, env={"SMARTCKPT_REMOTE": "s3://b/p", "SMARTCKPT_REMOTE_BANDWIDTH_MB": "2.5"}
    )
    assert s.remote == "s3://b/p" and s.remote_bandwidth_mb == 2.5 and s.remote_workers == 4
