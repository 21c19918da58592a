"""The RAM tier: each rank's newest snapshot in shared memory that outlives the training process.

Real processes write it (a training script run twice, the first one ending with ``os._exit``
as a crash would, without a close), real files in ``/dev/shm`` (or the test's temporary folder
when there is none) hold it, and the restore reads it back. ``smartckpt run`` end to end (a real
SIGKILL, the flash persist, the area removed) is in the slow tests at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smartckpt_cli.config import load_settings, parse_size
from smartckpt_cli.ops.verify import verify
from smartckpt_cli.remote.check import reach
from smartckpt_cli.remote.replica import open_remote, replica_journal
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.names import InvalidName, ram_area
from smartckpt_cli.store.storage.local import LocalStorage
from smartckpt_cli.supervise.childreport import restart_phases
from smartckpt_cli.supervise.ramowner import RamOwner
from tests._state import assert_same_state

ROOT = Path(__file__).resolve().parents[1]

# Trains a small model with a fixed per-step batch; RAM snapshots every 0.05 s, the disk every
# 1,000 steps (so a restart restores the RAM snapshot or, when it fails, step 0 / the disk).
# argv: store, total steps, "crash" (os._exit, no close) | "finish" (final state to out.pt).
TRAIN = r"""
import json, os, sys, time, logging
import torch
import smartckpt_cli as sc
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
store, total, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mgr = sc.CheckpointManager(store, every_steps=int(os.environ.get("EVERY", "1000")), ram_every=0.05)
mgr.register(model=model, optimizer=opt)
start = mgr.restore()
print("START", json.dumps({"step": start, "from": mgr._restored_from}), flush=True)
for step in range(start + 1, total + 1):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mgr.step(step, loss)
    time.sleep(0.01)
if end in ("crash", "crash-in-copy"):
    mgr.wait()
    ram = mgr._ram
    print("RAM", json.dumps({"step": ram.last["step"] if ram and ram.last else None,
                             "snapshots": ram.snapshots if ram else 0,
                             "private_staging": mgr._stager.nbytes}), flush=True)
    if end == "crash":
        os._exit(0)
    # SIGKILLed while the next snapshot is copied into the RAM tier: the first state_dict()
    # the snapshot asks for comes after the slot was handed out for writing
    import signal
    model.state_dict = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    mgr.save(total)
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
           os.path.join(os.path.dirname(store), "out.pt"))
mgr.close()
"""


def _train(
    tmp_path: Path, child_env, area: Path | None, total: int, end: str, *, rc: int = 0, **extra: str
) -> dict:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(child_env, **extra)
    if area is not None:
        env[ramarea.ENV_AREA] = str(area)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(total), end],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == rc, out.stdout + out.stderr
    said: dict = {"log": [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("LOG ")]}
    for line in out.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in ("START", "RAM"):
            said[tag] = json.loads(rest)
    return said


def _reference(tmp_path: Path, child_env, total: int) -> dict:
    ref = tmp_path / "reference"
    ref.mkdir()
    _train(ref, child_env, None, total, "finish")
    return torch.load(ref / "out.pt", weights_only=True)


def _flip_a_byte(area: Path) -> str:
    rank = area / "rank0"
    rec = json.loads((rank / "ram.json").read_text())
    entry = next(k for k, e in rec["entries"].items() if e["tier"] == "L1" and e["nbytes"] > 64)
    off = rec["entries"][entry]["offset"] + 5
    with open(rank / rec["slot"], "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    return entry


# ---------------------------------------------------------------- the format, no training


def _record_of(tmp_path: Path) -> Path:
    rank = tmp_path / "rank0"
    rank.mkdir()
    data = bytes(range(256)) * 4  # one float32 entry of 256 values
    (rank / "slot0").write_bytes(data)
    ramarea.write_record(
        rank,
        {
            "store_id": "ab" * 8,
            "id": "0123456789ab",
            "step": 7,
            "slot": "slot0",
            "slot_size": len(data),
            "objects": {},
            "entries": {
                "model/w": {
                    "tier": "L1",
                    "dtype": "float32",
                    "shape": [256],
                    "offset": 0,
                    "nbytes": len(data),
                    "chunks": ramarea.chunk_hashes(memoryview(data), 512),
                }
            },
        },
    )
    return rank


def test_a_record_reads_back_and_every_chunk_verifies(tmp_path):
    rank = _record_of(tmp_path)
    rec = ramarea.read_record(rank)
    assert rec is not None and rec["step"] == 7 and len(rec["entries"]["model/w"]["chunks"]) == 2
    with ramarea.reading(rank, "slot0") as view:
        assert ramarea.verify(view, rec) is None
    with open(rank / "slot0", "r+b") as f:  # one bit of the second chunk
        f.seek(700)
        b = f.read(1)
        f.seek(700)
        f.write(bytes([b[0] ^ 1]))
    with ramarea.reading(rank, "slot0") as view:
        assert ramarea.verify(view, rec) == "entry model/w chunk 1 (bytes 512..1024 of slot0) fails its hash"


def test_verify_copies_every_chunk_to_its_place_and_names_the_first_bad_one_on_many_threads(tmp_path):
    rank = tmp_path / "rank0"
    rank.mkdir()
    data = os.urandom(64 * 1000 + 100)  # two entries, 24 chunks of 5 000 bytes and a short one
    (rank / "slot0").write_bytes(data)
    a, b = memoryview(data)[:64000], memoryview(data)[64000:]
    rec = {
        "slot": "slot0",
        "entries": {
            "model/a": {"offset": 0, "chunks": ramarea.chunk_hashes(a, 5000)},
            "model/b": {"offset": 64000, "chunks": ramarea.chunk_hashes(b, 5000)},
        },
    }
    for workers in (1, 4):
        got = {"model/a": bytearray(64000), "model/b": bytearray(100)}

        def copy(key: str, at: int, chunk: memoryview, got=got) -> None:
            got[key][at : at + len(chunk)] = chunk

        with ramarea.reading(rank, "slot0") as view:
            assert ramarea.verify(view, rec, copy, workers=workers) is None
        assert bytes(got["model/a"]) == bytes(a) and bytes(got["model/b"]) == bytes(b)
    with open(rank / "slot0", "r+b") as f:  # chunks 3 and 9 of model/a both damaged
        for at in (15001, 45001):
            f.seek(at)
            f.write(bytes([data[at] ^ 0xFF]))
    with ramarea.reading(rank, "slot0") as view:
        for workers in (1, 4):
            said = ramarea.verify(view, rec, lambda *_: None, workers=workers)
            assert said == "entry model/a chunk 3 (bytes 15000..20000 of slot0) fails its hash"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"slot": "../x"}, "slot"),
        ({"slot": "slot1"}, "slot1 is missing"),
        ({"slot_size": 1 << 20}, "holds 1024 bytes, the record 1048576"),
        ({"step": -1}, "step"),
        ({"entries": {"model/w": {"tier": "L1", "dtype": "float32", "shape": [512], "offset": 0,
                                  "nbytes": 2048, "chunks": [[2048, "00" * 16]]}}}, "does not fit"),
        ({"entries": {"model/w": {"tier": "L1", "dtype": "float32", "shape": [256], "offset": 0,
                                  "nbytes": 1024, "chunks": [[1000, "00" * 16]]}}}, "cover 1000 of 1024"),
        ({"entries": {"model/w": {"tier": "L1", "dtype": "nope", "shape": [1], "offset": 0,
                                  "nbytes": 4, "chunks": [[4, "00" * 16]]}}}, "dtype 'nope' is unknown"),
        ({"format": "other"}, "is not a RAM tier record"),
    ],
)  # fmt: skip
def test_a_damaged_or_foreign_record_is_refused_naming_the_field(tmp_path, change, said):
    rank = _record_of(tmp_path)
    rec = json.loads((rank / "ram.json").read_text())
    rec.update(change)
    (rank / "ram.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=None) as err:
        ramarea.read_record(rank)
    assert said in str(err.value)


def test_layout_aligns_every_entry_and_names_are_checked():
    offsets, size = ramarea.layout([("a", 3), ("b", 64), ("c", 0), ("d", 65)])
    assert offsets == {"a": 0, "b": 64, "c": 128, "d": 192} and size == 320
    with pytest.raises(InvalidName):
        ram_area("../etc")


def test_sizes_and_settings():
    assert parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("lots")
    s, sources = load_settings(env={"SMARTCKPT_RAM_EVERY": "1.5", "SMARTCKPT_RAM_BUDGET": "2G"})
    assert s.ram_every == 1.5 and s.ram_budget == "2G" and "ram_every" in sources


@pytest.mark.parametrize(
    ("value", "ranks"), [("4", 4), (" 2 ", 2), ("0", 1), ("-3", 1), ("eight", 1), ("", 1)]
)
def test_local_ranks_take_a_positive_count_and_nothing_else(monkeypatch, value, ranks):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert ramarea.local_ranks() == ranks


def test_restart_phases_come_from_the_childs_wall_times():
    assert restart_phases(100.0, {"restore_began": 102.0}) is None
    got = restart_phases(100.0, {"restore_began": 102.0, "restore_done": 102.5, "first_step_done": 103.0})
    assert got == {"to_restore": 2.0, "restore": 0.5, "to_first_step": 0.5, "start_to_first_step": 3.0}


def _resident(path: Path) -> int:
    """Bytes of ``path``'s mapping in this process's page tables (/proc/self/smaps ``Rss``): the
    pages a copy into it will not fault in again."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(head[1]) * 1024
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_a_slot_is_faulted_in_before_the_first_snapshot_copies_into_it(area, tmp_path, monkeypatch):
    """Deliver 3: the slot's pages are in the training process's page tables before the first
    save copies into it (the preparing thread wrote each one), so that copy faults nothing."""
    import smartckpt_cli as sc
    from smartckpt_cli.engine.ramtier import _fault_in

    slot = ramarea.Slot(area / "probe", 8 << 20)
    try:
        assert _resident(area / "probe") < 1 << 20  # fallocated, not yet in this process's tables
        _fault_in(slot.map)
        assert _resident(area / "probe") >= 8 << 20
    finally:
        slot.close()
    monkeypatch.setenv(ramarea.ENV_AREA, str(area))
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    mgr = sc.CheckpointManager(tmp_path / "ck", every_steps=1000, ram_every=1e9)
    mgr.register(model=model, optimizer=opt)
    mgr.restore()
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    mgr.step(1)  # the first step after register: the slots are planned and prepared
    ram = mgr._ram
    assert ram is not None and ram.size >= 3 * 2 * 512 * 513 * 4  # weights and both moments
    ram.wait_ready()
    slots = [p for p in area.rglob("slot*") if p.stat().st_size == ram.size]
    assert slots and all(_resident(p) >= ram.size for p in slots), [(p, _resident(p)) for p in slots]
    mgr.close()


# ---------------------------------------------------------------- real training processes


def test_a_crashed_process_restores_from_ram_bit_exact(tmp_path, child_env, area):
    first = _train(tmp_path, child_env, area, 60, "crash")
    ram_step = first["RAM"]["step"]
    assert first["RAM"]["snapshots"] >= 2 and 1 <= ram_step <= 60
    # the disk has no checkpoint (every 1,000 steps): only the RAM snapshot holds the work
    assert Journal(LocalStorage(tmp_path / "store"), tmp_path / "store").read().records == []
    second = _train(tmp_path, child_env, area, 90, "finish")
    assert second["START"] == {"step": ram_step, "from": "ram"}
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), _reference(tmp_path, child_env, 90))


@pytest.mark.parametrize("slots", [1, 2])
def test_a_crash_during_the_copy_into_the_ram_tier_costs_its_snapshot_only_with_one_slot(
    tmp_path, child_env, area, slots
):
    """SIGKILL while a snapshot is being copied into the RAM tier (the disk holds nothing: every
    1,000 steps). One slot (the default): the RAM tier is one copy of the state, the record was
    withdrawn before the copy began, so nothing torn is ever restored: the restart begins at 0.
    Two slots (``ram_slots: 2``, a second copy of the state): the previous RAM snapshot stays
    whole and the restart resumes from it. Both end bit-exact with an uninterrupted run."""
    env = {"SMARTCKPT_RAM_SLOTS": str(slots)}
    first = _train(tmp_path, child_env, area, 40, "crash-in-copy", rc=-9, **env)
    ram_step = first["RAM"]["step"]
    assert first["RAM"]["snapshots"] >= 2 and 1 <= ram_step <= 40, first
    assert first["RAM"]["private_staging"] == 0, first  # staged in the slot, no private copy beside it
    rank = area / "rank0"
    sizes = {p.name: p.stat().st_size for p in rank.glob("slot*")}
    assert sorted(sizes) == [f"slot{i}" for i in range(slots)], sizes
    assert (rank / "ram.json").exists() == (slots == 2)
    second = _train(tmp_path, child_env, area, 50, "finish", **env)
    assert second["START"] == ({"step": 0, "from": None} if slots == 1 else {"step": ram_step, "from": "ram"})
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), _reference(tmp_path, child_env, 50))


def test_a_flipped_byte_sends_the_restore_to_disk_with_one_line(tmp_path, child_env, area):
    first = _train(tmp_path, child_env, area, 40, "crash", EVERY="20")  # disk: step 20 and 40
    ram_step = first["RAM"]["step"]
    assert ram_step == 40  # the disk's save of step 40 is also a RAM snapshot
    entry = _flip_a_byte(area)
    second = _train(tmp_path, child_env, area, 50, "finish", EVERY="20")
    assert second["START"] == {"step": 40, "from": "disk"}
    damaged = [ln for ln in second["log"] if "damaged" in ln]
    assert len(damaged) == 1, second["log"]
    assert f"the RAM snapshot of step 40 is damaged: entry {entry} chunk 0" in damaged[0]
    assert "fails its hash; restoring from disk" in damaged[0]
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), _reference(tmp_path, child_env, 50))


def test_no_room_is_one_line_and_the_tier_stands_down(tmp_path, child_env, area):
    first = _train(tmp_path, child_env, area, 30, "crash", SMARTCKPT_RAM_BUDGET="16K")  # the state: 55 KB
    assert (first["RAM"]["step"], first["RAM"]["snapshots"]) == (None, 0)
    down = [ln for ln in first["log"] if "stands down" in ln]
    assert len(down) == 1 and "above ram_budget" in down[0], first["log"]
    assert not (area / "rank0" / "slot0").exists()  # nothing allocated beyond the budget
    second = _train(tmp_path, child_env, area, 35, "finish")
    assert second["START"] == {"step": 0, "from": None}


def test_flash_persist_writes_the_ram_snapshot_as_a_checkpoint_torch_free(tmp_path, child_env, area):
    first = _train(tmp_path, child_env, area, 50, "crash")
    ram_step = first["RAM"]["step"]
    lines: list[tuple[str, str]] = []
    owner = RamOwner(area, 1 << 30, lambda level, msg: lines.append((level, msg)))
    assert owner.persist(tmp_path / "store", None, 0, level=1) == ram_step
    assert lines and f"the RAM snapshot of step {ram_step} is a checkpoint of the store now" in lines[-1][1]
    (rec,) = Journal(LocalStorage(tmp_path / "store"), tmp_path / "store").read().records
    assert rec.step == ram_step and rec.reason == "flash persist" and rec.event.get("lineage")
    # nothing newer than the disk now: a second persist writes nothing
    assert owner.persist(tmp_path / "store", None, ram_step, level=1) is None
    verify = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "verify", str(tmp_path / "store")],
        env=child_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # the disk copy restores (no RAM area) and trains on to the same bits
    second = _train(tmp_path, child_env, None, 80, "finish")
    assert second["START"] == {"step": ram_step, "from": "disk"}
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), _reference(tmp_path, child_env, 80))


@pytest.mark.parametrize("remote", ["up", "unwritable"])
def test_a_flash_persist_no_attempt_follows_goes_to_the_remote_when_the_run_ends(
    tmp_path, child_env, area, remote
):
    """What ``smartckpt run`` does at the end of a run after a flash persist (RamOwner.close):
    the checkpoint goes to the remote with the training's own uploader; a remote it cannot write
    to costs one line naming the error, at most ``remote_close_wait``, and no traceback."""
    ram_step = _train(tmp_path, child_env, area, 50, "crash")["RAM"]["step"]
    target = tmp_path / "remote"
    if remote == "unwritable":
        target.write_text("a file where the remote's directory would be")
    url = f"file://{target}"
    settings, _ = load_settings(
        env={"SMARTCKPT_REMOTE": url, "SMARTCKPT_REMOTE_CLOSE_WAIT": "2", "SMARTCKPT_REMOTE_RETRIES": "1"}
    )
    lines: list[tuple[str, str]] = []
    owner = RamOwner(area, 1 << 30, lambda level, msg: lines.append((level, msg)), settings)
    assert owner.persist(tmp_path / "store", None, 0, level=1) == ram_step
    owner.close()
    assert not area.exists()
    if remote == "unwritable":
        assert lines[-1][0] == "warning", lines
        assert lines[-1][1].startswith(f"flash persist: step {ram_step} is not on the remote {url} ("), lines
        assert (
            "NotADirectoryError" in lines[-1][1] and "the next run on this store uploads it" in lines[-1][1]
        )
        return
    assert lines[-1][0] == "info" and lines[-1][1].startswith(
        f"flash persist: step {ram_step} is on the remote {url} now"
    ), lines
    rem = open_remote(url)
    state = replica_journal(rem).read()
    assert [r.step for r in state.live()] == [ram_step]
    (check,) = verify(reach(url), step=ram_step).results
    assert check.ok, check


def test_flash_persist_behind_holds_the_next_commit_until_it_is_written(tmp_path, child_env, area):
    """The restart does not wait for the flash persist; the next process's first commit does
    (``flash.lock``, held from before the restart until the journal line is written)."""
    ram_step = _train(tmp_path, child_env, area, 50, "crash")["RAM"]["step"]
    got: list[int | None] = []
    owner = RamOwner(area, 1 << 30, lambda level, msg: None)
    assert owner.persist_behind(tmp_path / "store", None, 0, level=1, done=got.append) == ram_step
    ramarea.flash_wait(area)  # what a training process's commit does first
    (rec,) = Journal(LocalStorage(tmp_path / "store"), tmp_path / "store").read().records
    assert rec.step == ram_step and rec.reason == "flash persist"
    owner.wait()
    assert got == [ram_step]


def test_flash_persist_refuses_a_damaged_snapshot(tmp_path, child_env, area):
    _train(tmp_path, child_env, area, 30, "crash")
    entry = _flip_a_byte(area)
    lines: list[tuple[str, str]] = []
    owner = RamOwner(area, 1 << 30, lambda level, msg: lines.append((level, msg)))
    assert owner.persist(tmp_path / "store", None, 0, level=1) is None
    assert (
        lines[-1][0] == "warning"
        and f"entry {entry} chunk 0" in lines[-1][1]
        and "fails its hash" in lines[-1][1]
    )
    assert Journal(LocalStorage(tmp_path / "store"), tmp_path / "store").read().records == []
    assert not list((tmp_path / "store" / "manifests").glob("*.json"))


# ---------------------------------------------------------------- smartckpt run end to end

SUPERVISED = ROOT / "tests" / "scripts" / "supervised_train.py"


@pytest.mark.slow
def test_sigkill_under_smartckpt_run_resumes_from_ram_bit_exact(tmp_path, child_env):
    """The disk every 1,000 steps, RAM snapshots every 0.3 s: a SIGKILL at step 45 of 60 loses
    only the steps since the newest RAM snapshot; the supervisor persists that snapshot before
    the restart, the restart restores it from RAM, and the result is bit-exact."""
    ref = tmp_path / "reference"
    ref.mkdir()
    subprocess.run(
        [sys.executable, str(SUPERVISED), "--total", "60", "--out", str(ref / "final.pt"), "--step-time", "0"],
        env=dict(child_env, SMARTCKPT_DIR=str(ref / "store")), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    # two slots: the kill finds a whole RAM snapshot whenever it comes (one slot: test below)
    env = dict(
        child_env, SMARTCKPT_RESTART_BACKOFF="0.1", SMARTCKPT_RAM_DIR=str(tmp_path), SMARTCKPT_RAM_SLOTS="2"
    )
    out = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "1000", "--ram-every",
         "0.3", str(SUPERVISED), "--total", "60", "--kill-at", "45", "--step-time", "0.03", "--out", "final.pt"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    assert_same_state(
        torch.load(tmp_path / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True)
    )
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    rec = json.loads(path.read_text())
    first, second = rec["attempts"]
    assert first["cause"] == "killed by SIGKILL" and first["max_step"] == 45
    # the newest RAM snapshot became a checkpoint before the restart, and the restart began there
    assert first["flash_persisted"] is not None and 0 < first["flash_persisted"] <= 45
    assert first["restart_from"] == second["start_step"] == first["flash_persisted"]
    assert first["steps_lost"] == 45 - first["flash_persisted"] < 45
    assert second["restored_from"] == "ram"
    assert {"detection", "relaunch", "imports", "to_restore", "restore", "to_first_step"} <= set(
        second["phases"]
    )
    assert f"flash persist: the RAM snapshot of step {first['flash_persisted']} is a checkpoint" in said
    assert f"attempt 1: resumed at step {second['start_step']} (restored from ram)" in said
    assert "RAM tier: " in said and "a snapshot every 0.3 s" in said
    assert not list(tmp_path.glob("smartckpt-*")), "the RAM area outlives the run"


DDP = ROOT / "tests" / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
def test_two_ranks_one_sigkilled_resume_from_ram_bit_exact(tmp_path, child_env):
    """Two DDP ranks under smartckpt run, the disk every 1,000 steps: rank 1 SIGKILLs itself at
    step 30; the supervisor persists both ranks' RAM snapshots of one step as a two-part
    checkpoint, both ranks restore that step from RAM, and the end is bit-exact."""
    env = dict(child_env, OMP_NUM_THREADS="1")
    ref = subprocess.run(
        [*TORCHRUN, str(DDP), "--mode", "ddp", "--dir", "ref", "--every", "5", "--total", "40", "--out", "ref"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    out = subprocess.run(
        [sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck", "--every", "1000", "--ram-every",
         "0.3", "--", *TORCHRUN, str(DDP), "--mode", "ddp", "--total", "40", "--kill-at", "30", "--kill-rank",
         "1", "--step-time", "0.05", "--out", "final"],
        cwd=tmp_path,
        env=dict(env, SMARTCKPT_RESTART_BACKOFF="0.1", SMARTCKPT_RAM_DIR=str(tmp_path), SMARTCKPT_RAM_SLOTS="2"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    for r in (0, 1):
        assert_same_state(
            torch.load(tmp_path / f"final.r{r}", weights_only=True),
            torch.load(tmp_path / f"ref.r{r}", weights_only=True),
        )
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    first, second = json.loads(path.read_text())["attempts"]
    step = first["flash_persisted"]
    assert step is not None and 0 < step <= 30 and second["start_step"] == step, said
    assert (
        second["restored_from"] == "ram" and f"rank 0 start {step}" in said and f"rank 1 start {step}" in said
    )
    (commit,) = [r for r in Journal(LocalStorage(tmp_path / "ck"), tmp_path / "ck").read().records]
    assert commit.step == step and commit.reason == "flash persist" and commit.world_size == 2
    assert not list(tmp_path.glob("smartckpt-*"))


# A state of 6.3 MB (0.5M float32 parameters and AdamW's two moments): each RAM slot is larger than
# the 2 MB tmpfs below. argv: total steps, the step before which the first attempt SIGKILLs itself.
BIG = r"""
import os, signal, sys, time
import torch
import smartckpt_cli as sc
total, kill_at = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mgr = sc.CheckpointManager()  # directory, schedule, RAM area: from smartckpt run
mgr.register(model=model, optimizer=opt)
start = mgr.restore()
print(f"start {start}", flush=True)
fill_at = int(os.environ.get("FILL_AT", "-1"))
for step in range(start, total):
    if step == kill_at and os.environ.get("SMARTCKPT_ATTEMPT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if step == fill_at and os.environ.get("SMARTCKPT_ATTEMPT") == "0":
        # another process takes every free byte of the tmpfs (its writes end at ENOSPC)
        import subprocess
        shm = os.environ["SMARTCKPT_RAM_DIR"]
        subprocess.run(["dd", "if=/dev/zero", f"of={shm}/filler", "bs=64k"], capture_output=True)
        st = os.statvfs(shm)
        print(f"filled at {step}: {st.f_bavail * st.f_frsize} bytes free", flush=True)
    loss = model(torch.randn(8, 256, generator=torch.Generator().manual_seed(step))).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mgr.step(step + 1, loss=loss)
    time.sleep(0.02)
mgr.close()
print(f"done {total}", flush=True)
"""


def _in_tmpfs(shm: Path, options: str) -> list[str]:
    """The command prefix that runs the rest of a command line with a tmpfs mounted on ``shm``,
    in a mount namespace of its own (the mount goes with the last process in it); a skip, with
    the reason, where this machine cannot mount one."""
    prefix = [
        "unshare",
        "-m",
        "--",
        "sh",
        "-c",
        f'mount -t tmpfs -o {options} tmpfs "$0" && exec "$@"',
        str(shm),
    ]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (unshare -m, mount -t tmpfs): {probe.stderr.strip()}")
    return prefix


def _run_in_tmpfs(
    tmp_path: Path, child_env, options: str, every: str, **extra: str
) -> tuple[str, list[dict], Path]:
    shm = tmp_path / "shm"
    shm.mkdir()
    script = tmp_path / "big.py"
    script.write_text(BIG)
    out = subprocess.run(
        [*_in_tmpfs(shm, options), sys.executable, "-m", "smartckpt_cli.cli.app", "run", "--dir", "ck",
         "--every", every, "--ram-every", "0.1", str(script), "40", "28"],
        cwd=tmp_path, env=dict(child_env, SMARTCKPT_RESTART_BACKOFF="0.1", SMARTCKPT_RAM_DIR=str(shm), **extra),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "done 40" in out.stdout, said
    assert "Traceback" not in said and "SIGBUS" not in said, said
    (path,) = (tmp_path / "ck" / "runs").glob("*.json")
    attempts = json.loads(path.read_text())["attempts"]
    assert [a["cause"] for a in attempts] == ["killed by SIGKILL", "finished"], said
    return said, attempts, shm


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "line", "lines"),
    [
        # a state of 6.3 MB: two slots do not fit (checked before anything is allocated)
        ("size=2m", "has 2.1 MB free: the RAM tier stands down, restarts restore from disk", 2),
        # no room for the run's RAM area (the supervisor's line; no training process tries)
        ("size=100m,nr_inodes=1", "RAM tier off: cannot use {shm} ([Errno 28] No space left on device", 1),
        # no room for a slot (an inode, here; posix_fallocate's ENOSPC takes the same way)
        ("size=100m,nr_inodes=3", "refused 6.3 MB for a RAM slot (No space left on device): the RAM tier "
         "stands down, restarts restore from disk", 2),
        # no room for the record naming a snapshot
        ("size=100m,nr_inodes=4", "failed (OSError: [Errno 28] No space left on device: '{shm}/smartckpt-", 2),
    ],
    ids=["state-larger-than-the-tmpfs", "no-room-for-the-area", "no-room-for-a-slot", "no-room-for-the-record"],
)  # fmt: skip
def test_a_full_tmpfs_is_one_line_the_tier_stands_down_and_the_restart_restores_from_disk(
    tmp_path, child_env, options, line, lines
):
    """``ram_dir`` on a real tmpfs that cannot take the RAM tier: one line from each process that
    meets it (never a SIGBUS, never a traceback), training goes on with the disk alone, and the
    restart after a SIGKILL restores the disk's newest checkpoint."""
    said, (first, second), shm = _run_in_tmpfs(tmp_path, child_env, options, every="10")
    down = [ln for ln in said.splitlines() if "restarts restore from disk" in ln]
    assert len(down) == lines, said
    assert all(ln.startswith("smartckpt: ") and line.format(shm=shm) in ln for ln in down), down
    assert first["flash_persisted"] is None, first
    assert second["restored_from"] == "disk" and second["start_step"] == 20, second


@pytest.mark.slow
def test_a_tmpfs_another_process_fills_during_the_run_never_ends_in_sigbus(tmp_path, child_env):
    """The tmpfs has room at the start (both slots allocated with posix_fallocate); at step 15
    another process takes every free byte of it (vllm#48879: a write into a mapped page of a
    full tmpfs is a SIGBUS). The slots' pages were the process's already: the snapshots go on
    into them; the record naming the next one finds no room: one line, the tier stands down,
    no signal. The SIGKILL at 28 then loses no checkpoint: the restart begins at the newest of
    the disk's and the RAM tier's last good snapshot, and says once why the tier stays down."""
    said, (first, second), _ = _run_in_tmpfs(tmp_path, child_env, "size=100m", every="10", FILL_AT="15")
    filled = re.search(r"^filled at 15: (\d+) bytes free$", said, re.M)
    assert filled and int(filled.group(1)) < (64 << 10), said
    down = [ln for ln in said.splitlines() if "the RAM tier stands down" in ln]
    assert len(down) == 2 and all(ln.startswith("smartckpt: ") for ln in down), said
    assert "No space left on device" in down[0], down  # the record, in the killed attempt
    assert "free: the RAM tier stands down" in down[1], down  # the restarted process's plan
    # nothing lost: the disk's checkpoints of steps 10 and 20, and the restart from the newest
    # of them or from the RAM snapshot recorded before the tmpfs filled (then made a checkpoint)
    steps = [e["step"] for e in (json.loads(ln) for ln in (tmp_path / "ck" / "journal.jsonl").read_text().splitlines())
             if e.get("event") == "commit"]  # fmt: skip
    assert {10, 20} <= set(steps), steps
    assert second["start_step"] >= 20 and second["restored_from"] in ("disk", "ram"), second
    if first["flash_persisted"] is not None:
        assert second["start_step"] == first["flash_persisted"] and first["flash_persisted"] <= 15, first


@pytest.mark.slow
def test_no_room_for_the_flash_lock_the_flash_persist_runs_before_the_restart(tmp_path, child_env):
    """Room for one RAM snapshot and nothing else (6 inodes: the tmpfs, the area, a rank, 2 slots
    with ``ram_slots`` 2, the record), the disk every 1,000 steps: the supervisor cannot make the
    ``flash.lock`` that lets a flash persist run behind the restart, so it persists before it
    (the run used to end here, exit 1, on ENOSPC), and the restart restores that step."""
    said, (first, second), _ = _run_in_tmpfs(
        tmp_path, child_env, "size=100m,nr_inodes=6", every="1000", SMARTCKPT_RAM_SLOTS="2"
    )
    step = first["flash_persisted"]
    assert step is not None and 0 < step < 28, said
    assert f"flash persist: the RAM snapshot of step {step} is a checkpoint of the store now" in said
    assert second["start_step"] == step and second["restored_from"] == "ram", second
    down = [ln for ln in said.splitlines() if "the RAM tier stands down" in ln]
    assert len(down) == 2 and all("No space left on device" in ln for ln in down), said


def test_a_slot_the_tmpfs_cannot_hold_is_refused_before_it_is_mapped(tmp_path):
    """posix_fallocate on a real 2 MB tmpfs: a slot of 4 MB, and a 1 MB slot grown to 3 MB, are
    refused with ENOSPC before any page is mapped (no SIGBUS later); the tmpfs takes back what
    the failed call had allocated, and the grown slot keeps its old size and mapping."""
    shm = tmp_path / "shm"
    shm.mkdir()
    code = r"""
import errno, sys
from pathlib import Path
from smartckpt_cli.store import ramarea
d = Path(sys.argv[1])
free = ramarea.room(d)
try:
    ramarea.Slot(d / "slot0", 4 << 20)
    print("4 MB: allocated")
except OSError as err:
    print("4 MB:", errno.errorcode[err.errno], ramarea.room(d) == free)
slot = ramarea.Slot(d / "slot1", 1 << 20)
slot.map[-1] = 7
try:
    slot.resize(3 << 20)
    print("grown: allocated")
except OSError as err:
    print("grown:", errno.errorcode[err.errno], ramarea.room(d) == free - (1 << 20), len(slot.map), slot.map[-1])
"""
    out = subprocess.run(
        [*_in_tmpfs(shm, "size=2m"), sys.executable, "-c", code, str(shm)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["4 MB: ENOSPC True", f"grown: ENOSPC True {1 << 20} 7"], out.stdout


def test_a_failed_snapshot_keeps_the_ram_tier_and_what_its_slot_holds(tmp_path, area, monkeypatch, caplog):
    """A save whose ``state_dict()`` raises, with the RAM tier's one slot already handed out and a
    frozen layer referenced in it (unchanged since the last RAM snapshot): the failure is one
    save's; the next RAM snapshots still find the frozen entries in place (they were never
    rewritten), the tier stays up, and a new process restores the newest one from RAM, exactly."""
    import logging

    import smartckpt_cli as sc

    monkeypatch.setenv(ramarea.ENV_AREA, str(area))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model[0].requires_grad_(False)  # frozen: referenced by every RAM snapshot after the first
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    orig = model.state_dict
    armed = {"fail": False}

    def flaky(*args, **kwargs):
        if armed["fail"]:
            armed["fail"] = False
            raise RuntimeError("state_dict failed once")
        return orig(*args, **kwargs)

    def train(step):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    with (
        caplog.at_level(logging.WARNING),
        sc.CheckpointManager(tmp_path / "st", every_steps=1000, ram_every=1e-3) as mgr,
    ):
        mgr.register(model=model, optimizer=opt)
        model.state_dict = flaky
        for step in range(1, 7):
            train(step)
            mgr.step(step)
            mgr.wait()
        before = ramarea.read_record(area / "rank0")
        assert before is not None and before["step"] == 6
        armed["fail"] = True
        train(7)
        mgr.save(7)  # the snapshot raises: a failed save, the slot handed back
        mgr.wait()
        assert not armed["fail"] and any("state_dict failed once" in f for f in mgr.failures)
        for step in range(8, 12):
            train(step)
            mgr.step(step)
            mgr.wait()
        expected = {k: v.clone() for k, v in orig().items()}
        expected_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    assert not [r for r in caplog.records if "stands down" in r.getMessage()], caplog.text
    rec = ramarea.read_record(area / "rank0")
    assert rec is not None and rec["step"] == 11
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    fresh[0].requires_grad_(False)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    with sc.CheckpointManager(tmp_path / "st") as mgr:
        mgr.register(model=fresh, optimizer=fresh_opt)
        assert mgr.restore() == 11
        assert mgr._restored_from == "ram"
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for k, v in expected_opt.items():
        assert torch.equal(fresh_opt.state_dict()["state"][0][k], v), k
