"""A damaged journal never costs checkpoints (store/unjournalled.py, ops/repair.py).

The journal is emptied, overwritten with random bytes, or has a commit line garbled in the
middle, with the manifests and blobs still there. Then: ``inspect`` and ``verify`` say how many
checkpoints the journal lost and exit 1; a writer (the API, ``smartckpt run``) refuses to start
a new journal over them (one line, exit 1) and deletes nothing; ``smartckpt verify --repair``
rebuilds the journal from the manifests that verify, and the training resumes from the newest
one bit for bit. The deciding rule is tested pure first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smartckpt_cli.store.unjournalled import JournalLook, judge
from tests._state import assert_same_state

ROOT = Path(__file__).resolve().parents[1]

M = [f"manifests/{s:012d}-{c}.json" for s, c in ((5, "a" * 12), (10, "b" * 12), (15, "c" * 12))]


def _look(**kw: object) -> JournalLook:
    base: dict[str, object] = {
        "path": "j",
        "present": True,
        "error": None,
        "store_id": "1234abcd",
        "damaged": (),
        "named": frozenset(M[:2]),
    }
    base.update(kw)
    return JournalLook(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("look", "ids", "expect"),
    [
        # a sound journal: the one manifest no line names is an interrupted commit's leftover
        (_look(), {M[2]: "1234abcd"}, []),
        (_look(), {M[2]: None}, []),  # unreadable leftover: nothing to keep
        # ... unless it belongs to another store: kept, said, not blocking
        (_look(), {M[2]: "ffff0000"}, [(False, True, (15,))]),
        # lines lost in the middle: every manifest no line names may be one of them
        (_look(damaged=("j line 3",)), {}, [(False, False, (15,))]),
        (_look(damaged=("j line 3",), named=frozenset(M)), {}, []),
        # emptied or missing journal beside manifests: a writer must not start a journal
        (_look(store_id=None, named=frozenset()), {}, [(True, False, (5, 10, 15))]),
        (_look(present=False, store_id=None, named=frozenset()), {}, [(True, False, (5, 10, 15))]),
        # unreadable: blocking, with or without manifests
        (_look(error="garbage", store_id=None, named=frozenset()), {}, [(True, False, (5, 10, 15))]),
    ],
)
def test_judge(look: JournalLook, ids: dict, expect: list) -> None:
    got = judge(look, M, ids)
    assert [(f.blocking, f.foreign, f.steps) for f in got] == expect


def test_judge_says_an_empty_journal_without_manifests_is_a_new_store() -> None:
    assert judge(_look(store_id=None, named=frozenset()), [], {}) == []
    (f,) = judge(_look(error="not a smartckpt journal", store_id=None, named=frozenset()), [], {})
    assert f.blocking and "move it away" in f.line("st", "smartckpt verify --repair st")


# ---------------------------------------------------------------------------- end to end


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["SMARTCKPT_KEEP_LAST"] = "10"
    return env


def _train(store: Path, steps: int, out: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "smartckpt_cli.ops.demo_train", "--dir", str(store), "--steps", str(steps),
           "--save-every", "5"] + (["--out", str(out)] if out else [])  # fmt: skip
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", *args],
        env=_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _manifests(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "manifests").iterdir())


def _blobs(store: Path) -> set[str]:
    return {p.name for p in (store / "blobs").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """A store of 30 steps (a checkpoint every 5), and an uninterrupted 40-step run's final state."""
    d = tmp_path_factory.mktemp("unjournalled")
    assert _train(d / "ref", 40, d / "ref.pt").returncode == 0
    proc = _train(d / "store", 30)
    assert proc.returncode == 0, proc.stderr
    return d / "store", torch.load(d / "ref.pt", weights_only=True)


@pytest.fixture
def store(trained, tmp_path) -> Path:
    import shutil

    dst = tmp_path / "store"
    shutil.copytree(trained[0], dst)
    return dst


pytestmark = pytest.mark.slow


def test_an_emptied_journal_is_said_refused_repaired_and_resumes_bit_exact(store, trained, tmp_path):
    manifests, blobs = _manifests(store), _blobs(store)
    (store / "journal.jsonl").write_bytes(b"")
    lost = f"the journal {store}/journal.jsonl is empty; manifests/ holds 6 checkpoints (steps 5..30)"

    for command in ("inspect", "verify"):
        got = _cli(command, str(store))
        assert got.returncode == 1 and got.stdout == "", got
        assert got.stderr.startswith(f"smartckpt: error: checkpoint store {store}: {lost}"), got.stderr
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr

    # the API: restore() never returns 0 over them; nothing is deleted
    proc = _train(store, 40)
    assert proc.returncode != 0 and "StoreDamagedError" in proc.stderr and lost in proc.stderr, proc.stderr
    # smartckpt run: one line, exit 1, before any attempt
    got = _cli("run", "--dir", str(store), "--", sys.executable, "-m", "smartckpt_cli.ops.demo_train",
               "--dir", str(store), "--steps", "40", "--save-every", "5")  # fmt: skip
    out = got.stdout + got.stderr
    assert got.returncode == 1 and "Traceback" not in out, out
    assert [ln for ln in out.splitlines() if ln.strip()] == [
        f"smartckpt: error: checkpoint store {store}: "
        + out.split(f"checkpoint store {store}: ", 1)[1].strip()
    ]
    assert f"`smartckpt verify --repair {store}`" in out
    assert _manifests(store) == manifests and _blobs(store) == blobs
    assert (store / "journal.jsonl").read_bytes() == b""

    got = _cli("verify", "--repair", str(store))
    assert got.returncode == 0, got
    assert "repair: journal rebuilt with 6 checkpoint(s) put back (steps 5, 10, 15, 20, 25, 30)" in got.stdout
    assert got.stdout.count(": ok") == 6, got.stdout
    assert [p.name for p in store.glob("journal.jsonl.before-repair-*")]
    rows = json.loads(_cli("inspect", str(store), "--json").stdout)["checkpoints"]
    assert [r["step"] for r in rows] == [30, 25, 20, 15, 10, 5] and rows[0]["restore_target"]

    proc = _train(store, 40, tmp_path / "final.pt")
    assert proc.returncode == 0, proc.stderr
    assert "restored step 30" in proc.stdout, proc.stdout
    assert_same_state(torch.load(tmp_path / "final.pt", weights_only=True), trained[1])


def test_a_journal_of_random_bytes_stops_smartckpt_run_at_once_in_one_line(store):
    manifests = _manifests(store)
    (store / "journal.jsonl").write_bytes(os.urandom(300).replace(b"\n", b"x"))
    got = _cli("run", "--dir", str(store), "--", sys.executable, "-m", "smartckpt_cli.ops.demo_train",
               "--dir", str(store), "--steps", "40", "--save-every", "5", timeout=60)  # fmt: skip
    out = got.stdout + got.stderr
    assert got.returncode == 1, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "journal.jsonl is not a smartckpt journal (no readable line)" in lines[0], out
    assert "manifests/ holds 6 checkpoints (steps 5..30)" in lines[0]
    assert _manifests(store) == manifests
    got = _cli("inspect", str(store))
    assert got.returncode == 1 and "is not a smartckpt journal" in got.stderr
    got = _cli("verify", "--repair", str(store))
    assert got.returncode == 0 and "6 checkpoint(s) put back" in got.stdout, got
    kept = next(store.glob("journal.jsonl.before-repair-*")).read_bytes()
    assert len(kept) == 300  # the damaged journal itself is kept as evidence


def test_a_garbled_commit_line_keeps_its_checkpoint_through_later_saves_until_repaired(store, tmp_path):
    lines = (store / "journal.jsonl").read_text().splitlines(keepends=True)
    i = next(n for n, ln in enumerate(lines) if '"step":20' in ln and '"commit"' in ln)
    lines[i] = lines[i].replace('"reason"', '"reaXon"')  # its crc no longer matches
    (store / "journal.jsonl").write_text("".join(lines))
    m20 = next(m for m in _manifests(store) if m.startswith("000000000020-"))

    got = _cli("inspect", str(store))
    assert got.returncode == 1, got
    assert f"line {i + 1} of the journal is damaged; manifests/ holds 1 checkpoint (step 20)" in got.stderr

    # the training goes on (the journal still reads) and its garbage collection keeps step 20
    env_keep = _env()
    env_keep["SMARTCKPT_KEEP_LAST"] = "2"
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.ops.demo_train", "--dir", str(store), "--steps", "45",
         "--save-every", "5"], env=env_keep, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "restored step 30" in proc.stdout
    assert m20 in _manifests(store)  # evidence: not collected, with its blobs
    assert "kept (never collected as garbage)" in proc.stderr
    got = _cli("verify", "--repair", str(store))
    assert got.returncode == 0 and "put back (steps 20)" in got.stdout, got
    got = _cli("verify", "--step", "20", str(store))
    assert got.returncode == 0 and ": ok" in got.stdout, got


def test_an_interrupted_commit_is_still_garbage(store):
    """A manifest no line of a sound journal names, of this store: the leftover of a commit cut
    short between manifest and journal line. The next save's garbage collection removes it."""
    newest = next(m for m in _manifests(store) if m.startswith("000000000030-"))
    leftover = "000000000035-0123456789ab.json"
    (store / "manifests" / leftover).write_bytes((store / "manifests" / newest).read_bytes())
    assert _cli("inspect", str(store)).returncode == 0
    env = _env()
    env["SMARTCKPT_KEEP_LAST"] = "2"  # garbage is collected after a prune
    proc = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.ops.demo_train", "--dir", str(store), "--steps", "40",
         "--save-every", "5"], env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert leftover not in _manifests(store)
    assert "never collected as garbage" not in proc.stderr


def test_a_missing_journal_is_not_a_store_and_says_where_the_manifests_are(store):
    (store / "journal.jsonl").unlink()
    got = _cli("inspect", str(store))
    assert got.returncode == 2, got
    assert "no journal.jsonl" in got.stderr and "manifests/ holds 6 manifest(s)" in got.stderr
    assert "pass it with --meta-dir" in got.stderr and f"smartckpt verify --repair {store}" in got.stderr
    proc = _train(store, 40)
    assert proc.returncode != 0 and "is missing (if it is in another directory" in proc.stderr
    got = _cli("verify", "--repair", str(store))
    assert got.returncode == 0 and "6 checkpoint(s) put back" in got.stdout, got


def test_a_damaged_newest_checkpoint_is_not_marked_as_the_resume_and_export_names_the_one_it_can(
    store, tmp_path
):
    m30 = json.loads(next((store / "manifests").glob("000000000030-*.json")).read_text())
    bid = m30["entries"]["model/0.weight"]["data"]["chunks"][0][0]
    (store / "blobs" / bid[:2] / bid).unlink()
    rows = json.loads(_cli("inspect", str(store), "--json").stdout)["checkpoints"]
    assert [r["step"] for r in rows if r["restore_target"]] == [25]
    assert "missing" in rows[0]["manifest_problem"]
    got = _cli("inspect", str(store))
    assert f"step 30 ({rows[0]['id']}) is damaged: blob {bid} is missing" in got.stderr
    got = _cli("export", str(store), str(tmp_path / "out.pt"))
    assert got.returncode == 1 and "Traceback" not in got.stderr
    assert "the newest checkpoint (step 30) is damaged" in got.stderr
    assert (
        f"the newest checkpoint that verifies is step 25: smartckpt export {store} OUT --step 25"
        in got.stderr
    )


def test_repair_refuses_while_a_run_writes_the_store(store):
    from smartckpt_cli.store.directory import open_store

    (store / "journal.jsonl").write_bytes(b"")
    held = open_store(store).writer_lock()
    held.acquire()
    try:
        got = _cli("verify", "--repair", str(store))
    finally:
        held.release()
    assert got.returncode == 1 and "already being written" in got.stderr, got
    assert (store / "journal.jsonl").read_bytes() == b""
