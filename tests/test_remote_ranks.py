"""The remote tier under torchrun: 2 CPU ranks (gloo), node-local ``dir`` per rank, a shared
``meta_dir``, moto's S3 server. Every rank uploads its own part and marks it; rank 0 writes the
remote commit of a step only once every rank's part is marked. Real processes, real SIGKILLs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from smartckpt_cli.cli.inspect_cmd import _remote_line
from smartckpt_cli.cli.run import _remote_cell
from smartckpt_cli.ops.verify import verify
from smartckpt_cli.remote.check import merge_status, prune_remote, reach, read_status, remote_summary
from smartckpt_cli.remote.fetch import manifest_blob_ids
from smartckpt_cli.remote.parts import (
    PARTS_DIR,
    marker_name,
    missing_markers,
    part_cid,
    status_name,
    still_pending,
)
from smartckpt_cli.remote.replica import open_remote, replica_journal
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.store.journal import CheckpointRecord, decode_manifest, fold
from tests._names import cid as _cid
from tests._names import commit
from tests._s3 import SECRET, MotoServer, all_objects, client, free_port, s3_env
from tests._state import assert_same_state

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TOTAL = 20
NODE_LOCAL = ["--dir", "local", "--node-local", "--meta-dir", "shared", "--every", "5"]


# ---------------------------------------------------------------- pure rules (fast)


def _rec(step: int, cid: str, ranks: int) -> CheckpointRecord:
    """A multi-rank commit line as the journal reads it (names checked)."""
    (record,) = fold([commit(step, _cid(cid), world=ranks)])[1]
    assert record.invalid is None and record.parts is not None
    return record


def test_status_of_several_ranks_names_the_slowest():
    a = {"remote": "s3://b/p", "world": 2, "rank": 0, "pending": 1, "pending_steps": [10], "lag_seconds": 2.0}
    b = {
        "rank": 1,
        "pending": 3,
        "pending_steps": [10, 15, 20],
        "lag_seconds": 9.5,
        "last_error": "OSError: x",
    }
    merged = merge_status([a, b])
    assert merged["slowest_rank"] == 1 and merged["lag_seconds"] == 9.5
    assert merged["pending"] == 1 and merged["last_error"] == "rank 1: OSError: x"
    assert "slowest rank 1" in _remote_line(merged)
    assert merge_status([a, None])["slowest_rank"] == 1  # a rank that wrote nothing yet is behind


def test_a_step_needs_every_ranks_marker():
    rec = _rec(10, "abc", 2)
    abc = _cid("abc")
    assert missing_markers(rec, set()) == [0, 1]
    assert missing_markers(rec, {marker_name(10, abc, 0)}) == [1]
    assert missing_markers(rec, {marker_name(10, abc, 0), marker_name(10, abc, 1)}) == []
    assert marker_name(10, abc, 1) != marker_name(10, abc, 0)  # no two writers collide
    assert status_name(0) == "remote-status.json" and status_name(1) == "remote-status-r1.json"


def test_parts_that_can_still_be_committed_and_the_abandoned_rest():
    # local journal: 5 (on the remote), 10 (never completed), 15 (on the remote), 20 (uploading)
    local = [_rec(5, "a5", 2), _rec(10, "a10", 2), _rec(15, "a15", 2), _rec(20, "a20", 2)]
    local = [replace(r, position=i) for i, r in enumerate(local)]
    a5, a10, a15, a20 = (_cid(x) for x in ("a5", "a10", "a15", "a20"))
    remote_ids = {a5, a15, _cid("old")}  # "old": committed once, pruned since
    assert still_pending(local, remote_ids, {a15}) == {a20}  # a10 was passed by a15
    assert still_pending(local, {a5}, {a5}) == {a10, a15, a20}
    assert still_pending(local, set(), set()) == {a5, a10, a15, a20}
    assert part_cid(f"000000000010-{a10}-r1.json") == a10
    assert part_cid(marker_name(7, _cid("9f3e"), 12)) == _cid("9f3e")
    assert part_cid(f"000000000010-{a10}.json") is None  # a one-process manifest
    assert part_cid("notes.txt") is None and part_cid(f"000000000010-{a10}-rx.json") is None
    assert part_cid("000000000010-a10-r1.json") is None  # not a checkpoint id: never ours


# ---------------------------------------------------------------- end to end (slow)


@pytest.fixture(scope="module")
def moto():
    server = MotoServer(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def s3(moto, request):
    bucket = "b-" + request.node.name.lower().replace("_", "-")[:50]
    client(moto.port).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/job", bucket, s3_env(moto.port)


@pytest.fixture(scope="module")
def env_base() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _torchrun(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 2) -> tuple[int, str]:
    cmd = [*TORCHRUN[:-1], str(nproc), str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env_base) -> list[dict]:
    """An uninterrupted 2-rank DDP run of the same script, no remote."""
    d = tmp_path_factory.mktemp("reference")
    rc, log = _torchrun(["--dir", "ck", "--every", "5", "--total", str(TOTAL), "--out", "ref"], d, env_base)
    assert rc == 0, log
    return [torch.load(d / f"ref.r{r}", weights_only=True) for r in (0, 1)]


def _remote_env(
    env_base: dict[str, str], s3: tuple[str, str, dict[str, str]], **extra: str
) -> dict[str, str]:
    url, _, aws = s3
    return {**env_base, **aws, "SMARTCKPT_REMOTE": url, "SMARTCKPT_REMOTE_RETRIES": "2", **extra}


@contextlib.contextmanager
def _aws(env: dict[str, str]) -> Iterator[None]:
    """This process talks to the test's S3 server with the test's throwaway credentials."""
    old = {k: os.environ.get(k) for k in env if k.startswith("AWS_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _remote_commits(url: str, env: dict[str, str]) -> list[CheckpointRecord]:
    with _aws(env):
        return sorted(replica_journal(open_remote(url)).read().live(), key=lambda r: r.step)


def _markers(port: int, bucket: str) -> set[str]:
    return {k.rsplit("/", 1)[-1] for k in all_objects(port, bucket) if f"/{PARTS_DIR}/" in k}


def _start(out: str) -> int:
    found = re.findall(r"rank 0 start (\d+)", out)
    assert found, out
    return int(found[0])


def _wipe(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "local")  # both node-local disks
    shutil.rmtree(tmp_path / "shared")  # and the shared meta_dir


@pytest.mark.slow
def test_both_node_disks_and_meta_dir_lost_resume_from_remote_bit_exact(
    tmp_path, s3, moto, env_base, reference
):
    """Must show 1: train, SIGKILL the group, delete both node-local dirs and the shared meta_dir,
    restart: the job resumes from the newest remote step, final weights equal bit for bit."""
    url, bucket, _ = s3
    env = _remote_env(env_base, s3)
    args = [*NODE_LOCAL, "--total", str(TOTAL), "--step-time", "0.25", "--out", "run"]
    rc, out = _torchrun([*args, "--kill-at", "17", "--kill-rank", "1", "--kill-after-remote"], tmp_path, env)
    assert rc != 0, out
    commits = _remote_commits(url, env)
    assert commits, out
    for rec in commits:  # every remote commit names both parts, each marked and present
        assert rec.event["world_size"] == 2 and len(rec.event["parts"]) == 2
        assert not missing_markers(rec, _markers(moto.port, bucket))
    newest = commits[-1].step
    _wipe(tmp_path)
    rc, out2 = _torchrun(args, tmp_path, env)
    assert rc == 0, out2
    assert _start(out2) == newest, out2
    assert "from remote" in out2
    assert_same_state(torch.load(tmp_path / "run.r0", weights_only=True), reference[0])
    assert_same_state(torch.load(tmp_path / "run.r1", weights_only=True), reference[1])
    # per-rank status files; `smartckpt run`'s status line names the slowest rank
    for r in (0, 1):
        st = json.loads((tmp_path / "shared" / status_name(r)).read_text())
        assert st["rank"] == r and st["pending"] == 0
    merged = read_status(tmp_path / "shared")
    assert merged is not None and [x["rank"] for x in merged["ranks"]] == [0, 1]
    assert "slowest rank" in (_remote_cell(tmp_path / "shared") or "")
    _verify_and_prune_every_part(url, env)
    # no secret anywhere
    assert SECRET not in out + out2
    assert all(SECRET.encode() not in v for v in all_objects(moto.port, bucket).values())


@pytest.mark.slow
def test_four_ranks_on_four_node_local_disks_resume_from_the_remote_bit_exact(tmp_path, s3, moto, env_base):
    """4 ranks, each with its own node-local dir, the journal in a shared meta_dir: rank 2 is
    SIGKILLed at step 17. Every remote commit names the 4 parts, each marked. With all 4 disks
    and the meta_dir lost, the job resumes at 4 ranks from the newest remote step, every rank
    fetching its own part only, and ends bit-exact with an uninterrupted 4-rank run."""
    url, bucket, _ = s3
    (tmp_path / "ref").mkdir()
    rc, log = _torchrun(
        ["--dir", "ck", "--every", "5", "--total", str(TOTAL), "--out", "ref"], tmp_path / "ref", env_base, 4
    )
    assert rc == 0, log[-3000:]
    reference = [torch.load(tmp_path / "ref" / f"ref.r{r}", weights_only=True) for r in range(4)]
    env = _remote_env(env_base, s3)
    args = [*NODE_LOCAL, "--total", str(TOTAL), "--step-time", "0.25", "--out", "run"]
    rc, out = _torchrun(
        [*args, "--kill-at", "17", "--kill-rank", "2", "--kill-after-remote"], tmp_path, env, 4
    )
    assert rc != 0, out[-3000:]
    ids = {(tmp_path / "local" / f"node{r}" / "dir.id").read_text() for r in range(4)}
    assert len(ids) == 4  # four disks: nothing written once for another
    commits = _remote_commits(url, env)
    assert commits, out[-3000:]
    for rec in commits:
        assert rec.event["world_size"] == 4 and len(rec.event["parts"]) == 4
        assert not missing_markers(rec, _markers(moto.port, bucket))
    newest = commits[-1].step
    _wipe(tmp_path)
    rc, out2 = _torchrun(args, tmp_path, env, 4)
    assert rc == 0, out2[-3000:]
    assert all(f"rank {r} start {newest}" in out2 for r in range(4)), out2[-3000:]
    for r in range(4):
        assert_same_state(torch.load(tmp_path / f"run.r{r}", weights_only=True), reference[r])
        fetched = {p.name for p in (tmp_path / "local" / f"node{r}" / "manifests").glob(f"{newest:012d}-*")}
        assert fetched and all(n.endswith(f"-r{r}.json") for n in fetched), (r, fetched)


@pytest.mark.slow
def test_upload_killed_between_the_ranks_parts_leaves_no_remote_commit(
    tmp_path, s3, moto, env_base, reference
):
    """Must show 2: rank 1 is killed in its second part's upload (step 10), after rank 0's part:
    no remote commit for step 10; a restore from the remote takes the previous one."""
    url, bucket, _ = s3
    env = _remote_env(env_base, s3)
    args = [*NODE_LOCAL, "--total", str(TOTAL), "--step-time", "0.3", "--out", "run"]
    faults = {"SMARTCKPT_TEST_FAULTS": "1", "SMARTCKPT_FAULT": "remote.part@2", "SMARTCKPT_FAULT_RANK": "1"}
    rc, out = _torchrun(args, tmp_path, {**env, **faults})
    assert rc != 0, out
    steps = [r.step for r in _remote_commits(url, env)]
    assert 10 not in steps and all(s < 10 for s in steps), (steps, out)
    markers = _markers(moto.port, bucket)
    assert not any(m.startswith(f"{10:012d}-") and m.endswith("-r1.json") for m in markers)
    _wipe(tmp_path)
    rc, out2 = _torchrun(args, tmp_path, env)
    assert rc == 0, out2
    assert _start(out2) == (steps[-1] if steps else 0), out2
    assert_same_state(torch.load(tmp_path / "run.r0", weights_only=True), reference[0])
    assert_same_state(torch.load(tmp_path / "run.r1", weights_only=True), reference[1])


@pytest.mark.slow
def test_one_ranks_uploads_failing_never_stall_training_nor_commit_a_missing_part(
    tmp_path, s3, moto, env_base, reference
):
    """Must show 3: rank 1's uploads always fail (its marker never goes up): both ranks train to
    the end at full speed and bit-exact, close() waits at most remote_close_wait, and the remote
    holds no commit (each would miss rank 1's part)."""
    url, bucket, _ = s3
    env = _remote_env(env_base, s3, SMARTCKPT_REMOTE_CLOSE_WAIT="3")
    faults = {"SMARTCKPT_TEST_FAULTS": "1", "SMARTCKPT_FAULT": "remote.part@*", "SMARTCKPT_FAULT_RANK": "1"}
    faults["SMARTCKPT_FAULT_MODE"] = "raise"
    args = [*NODE_LOCAL, "--total", str(TOTAL), "--out", "run"]
    t0 = time.monotonic()
    rc, out = _torchrun(args, tmp_path, {**env, **faults})
    took = time.monotonic() - t0
    assert rc == 0, out
    assert "rank 0 done 20" in out and "rank 1 done 20" in out
    assert_same_state(torch.load(tmp_path / "run.r0", weights_only=True), reference[0])
    assert_same_state(torch.load(tmp_path / "run.r1", weights_only=True), reference[1])
    assert took < 90, took  # a stalled rank would wait out the gloo timeout (900 s)
    assert _remote_commits(url, env) == []
    markers = _markers(moto.port, bucket)
    assert markers and not any(m.endswith("-r1.json") for m in markers)  # rank 0's parts went up
    st1 = json.loads((tmp_path / "shared" / status_name(1)).read_text())
    assert st1["pending"] >= 1 and "injected" in (st1["last_error"] or ""), st1
    st0 = json.loads((tmp_path / "shared" / status_name(0)).read_text())
    assert st0["pending"] >= 1, st0
    # `inspect --remote` asks the remote: rank 1 is the one behind
    store = open_store(tmp_path / "local" / "node0", tmp_path / "shared", create=False)
    state = store.journal.read()
    with _aws(env):
        view = remote_summary(state.records, state.store_id, url)
    assert view["ranks"][0]["pending"] == 0 and view["ranks"][1]["pending"] >= 1, view
    assert "per rank: rank 0 0 behind, rank 1" in _remote_line(view)
    merged = read_status(tmp_path / "shared")
    assert merged is not None and merged["slowest_rank"] == 1 and "rank 1" in (merged["last_error"] or "")


def _verify_and_prune_every_part(url: str, env: dict[str, str]) -> None:
    """verify --remote --all checks every rank's part; prune --remote keeps every blob a kept
    step's part on any rank references."""
    with _aws(env):
        remote = open_remote(url)
        journal = replica_journal(remote)
        checks = verify(reach(url), all_checkpoints=True).results
        assert len(checks) >= 2 and all(c.ok for c in checks), checks
        plan = prune_remote(remote, journal, 1)
        assert len(plan.keep) == 1 and plan.remove
        state = journal.read()
        checks = verify(reach(url), all_checkpoints=True).results
        assert len(checks) == 1 and checks[0].ok, checks
        kept = state.live()[0]
        parts = kept.event["parts"]
        ids = [set(manifest_blob_ids(decode_manifest(remote.read(p[0]), p[0]))) for p in parts]
        only_rank1 = sorted(ids[1] - ids[0])
        assert only_rank1  # rank 1's own state (its RNG) is in its part only
        for rel in [p[0] for rec in plan.remove for p in rec.event["parts"]]:
            assert not remote.exists(rel)  # every part manifest of a pruned step is gone
        remote.remove(f"blobs/{only_rank1[0][:2]}/{only_rank1[0]}")
        bad = verify(reach(url), all_checkpoints=True).results
        assert not bad[0].ok and only_rank1[0] in (bad[0].problem or "")


@pytest.mark.slow
def test_a_node_that_lost_its_part_downloads_only_its_own_and_another_world_size_resumes(
    tmp_path, s3, moto, env_base
):
    """One node's disk lost while the other keeps its part: only that rank downloads, only its own
    part. Then every disk and meta_dir lost, and the job comes back at 1 rank (elastic resume):
    it restores the newest remote step from the 2-rank parts."""
    url, _, _ = s3
    env = _remote_env(env_base, s3)
    rc, out = _torchrun([*NODE_LOCAL, "--total", "10"], tmp_path, env)
    assert rc == 0, out
    assert [r.step for r in _remote_commits(url, env)] == [5, 10]  # close() waited for the uploads
    shutil.rmtree(tmp_path / "local" / "node1")
    rc, out = _torchrun([*NODE_LOCAL, "--total", "12"], tmp_path, env)
    assert rc == 0, out
    assert "rank 0 start 10" in out and "rank 1 start 10" in out, out
    fetched = [line for line in out.splitlines() if "from remote" in line and "downloaded" in line]
    assert len(fetched) == 1 and "0 blob(s) were sound locally" in fetched[0], out
    own = {p.name for p in (tmp_path / "local" / "node1" / "manifests").iterdir()}
    assert own and all(n.endswith("-r1.json") for n in own), own  # rank 1's part, nothing else
    _wipe(tmp_path)
    rc, out = _torchrun([*NODE_LOCAL, "--total", "14"], tmp_path, env, nproc=1)
    assert rc == 0, out
    assert "rank 0 start 10" in out and "rank 1" not in out, out  # the newest remote step, at 1 rank
    assert "written by 2 rank(s), restored on 1" in out, out


@pytest.mark.slow
def test_preemption_of_one_rank_gets_every_part_up_before_exit(tmp_path, s3, env_base):
    """SIGTERM reaches rank 1 only: both ranks take the preemption save, each waits (up to
    remote_close_wait) for its part, rank 0 for the commit; the remote holds that step. With
    rank 1's uploads failing, every rank gives up after remote_close_wait and the remote holds
    no commit for the step."""
    url, _, _ = s3
    env = _remote_env(env_base, s3, SMARTCKPT_REMOTE_CLOSE_WAIT="4")
    # Ranks agree on a signal within DECIDE_LATENCY (1 s: up to ~50 of these steps), so the
    # preemption step is not fixed: --total leaves room after it, and the second run's signal
    # comes a few steps after wherever the first run's save landed.
    args = [*NODE_LOCAL[:-1], "1000", "--total", "200", "--step-time", "0.02"]
    rc, out = _torchrun([*args, "--signal-at", "15", "--signal-rank", "1"], tmp_path, env)
    assert rc != 0, out
    journal = [json.loads(line) for line in (tmp_path / "shared" / "journal.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in journal if e["event"] == "commit"]
    assert len(saved) == 1, journal
    assert [r.step for r in _remote_commits(url, env)] == saved  # up before the processes exited

    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "shared")
    faults = {"SMARTCKPT_TEST_FAULTS": "1", "SMARTCKPT_FAULT": "remote.part@*", "SMARTCKPT_FAULT_RANK": "1"}
    faults["SMARTCKPT_FAULT_MODE"] = "raise"
    t0 = time.monotonic()
    again = str(saved[0] + 5)
    rc, out = _torchrun([*args, "--signal-at", again, "--signal-rank", "1"], tmp_path, {**env, **faults})
    assert rc != 0, out
    assert time.monotonic() - t0 < 60, out
    assert "rank 0 start " + str(saved[0]) in out, out
    journal = [json.loads(line) for line in (tmp_path / "shared" / "journal.jsonl").read_text().splitlines()]
    second = [
        e["step"] for e in journal if e["event"] == "commit" and e.get("reason", "").startswith("preemption")
    ]
    assert second and second[-1] > saved[0], journal
    assert [r.step for r in _remote_commits(url, env)] == saved  # the new step lacks rank 1's part


@pytest.mark.slow
def test_a_dead_runs_uncommitted_parts_are_collected_by_the_next_runs_retention(tmp_path, s3, moto, env_base):
    """Rank 1's uploads fail, so only parts of steps 5 and 10 reach the remote, never committed.
    The disks are lost; the next run (nothing to resume) commits at least 10, 15 and 20 and
    prunes to remote_keep_last 2: its retention collects the dead run's parts too. Afterwards the
    remote holds exactly the blobs its live checkpoints reference, and nothing of the dead run."""
    url, bucket, _ = s3
    env = _remote_env(env_base, s3, SMARTCKPT_REMOTE_CLOSE_WAIT="3")
    faults = {"SMARTCKPT_TEST_FAULTS": "1", "SMARTCKPT_FAULT": "remote.part@*", "SMARTCKPT_FAULT_RANK": "1"}
    faults["SMARTCKPT_FAULT_MODE"] = "raise"
    rc, out = _torchrun([*NODE_LOCAL, "--total", "10"], tmp_path, {**env, **faults})
    assert rc == 0, out
    markers = _markers(moto.port, bucket)
    dead = {part_cid(m) for m in markers}
    assert dead and all(m.endswith("-r0.json") for m in markers), (markers, out)  # rank 0's parts only
    assert _remote_commits(url, env) == [], out
    _wipe(tmp_path)

    env.update(SMARTCKPT_REMOTE_CLOSE_WAIT="60", SMARTCKPT_REMOTE_KEEP_LAST="2")
    rc, out = _torchrun([*NODE_LOCAL, "--total", str(TOTAL)], tmp_path, env)
    assert rc == 0, out
    assert _start(out) == 0, out
    live = _remote_commits(url, env)
    assert [r.step for r in live] == [15, 20], live
    objects = all_objects(moto.port, bucket)
    left = [k for k in objects if part_cid(k.rsplit("/", 1)[-1]) in dead]
    assert left == [], left  # no manifest and no marker of the dead run
    referenced = set()
    for rec in live:
        for part in rec.event["parts"]:
            referenced.update(manifest_blob_ids(decode_manifest(objects[f"job/{part[0]}"], part[0])))
    stored = {k.rsplit("/", 1)[-1] for k in objects if k.startswith("job/blobs/")}
    assert stored == referenced, (sorted(stored - referenced), sorted(referenced - stored))


@pytest.mark.slow
def test_zero_code_under_smartckpt_run_and_torchrun_ships_every_part_and_resumes_from_the_remote(
    tmp_path, s3, env_base, reference
):
    """`smartckpt run -- torchrun` with no CheckpointManager in the script and the remote set in
    the environment: rank 1 is SIGKILLed at step 13, the supervisor restarts the job, it ends
    bit-exact; every remote commit has both ranks' parts and verifies. With the local store lost,
    a new run resumes from the remote's newest step."""
    url, _, _ = s3
    env = _remote_env(env_base, s3, SMARTCKPT_RESTART_BACKOFF="0.1")
    run = [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "5", "--"]
    train = [*TORCHRUN[:-1], "2", str(SCRIPT), "--zero-code", "--total", str(TOTAL), "--out", "run"]
    proc = subprocess.run(
        [*run, *train, "--kill-at", "13", "--kill-rank", "1", "--step-time", "0.05"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    starts = re.findall(r"rank (\d) start (\d+)", out)
    assert sorted(starts[:2]) == [("0", "0"), ("1", "0")], out[-4000:]
    restarted = {int(s) for _, s in starts[2:]}  # both ranks from one committed step
    assert len(starts) == 4 and len(restarted) == 1 and restarted <= {5, 10}, out[-4000:]
    assert_same_state(torch.load(tmp_path / "run.r0", weights_only=True), reference[0])
    assert_same_state(torch.load(tmp_path / "run.r1", weights_only=True), reference[1])
    commits = _remote_commits(url, env)
    assert commits and commits[-1].step == TOTAL, [r.step for r in commits]  # the final save too
    assert all(len(r.event["parts"]) == 2 and r.event["world_size"] == 2 for r in commits)
    with _aws(env):
        checks = verify(reach(url), all_checkpoints=True).results
    assert checks and all(c.ok for c in checks), checks

    shutil.rmtree(tmp_path / "ck")
    proc = subprocess.run([*run, *train], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"rank 0 start {TOTAL}" in out and f"rank 1 start {TOTAL}" in out, out[-4000:]
    assert_same_state(torch.load(tmp_path / "run.r1", weights_only=True), reference[1])
