"""engine/coordinator.py: one process, and two real ranks (a gloo group of two CPU processes)
behind the same interface."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import smartckpt_cli as sc
from smartckpt_cli.engine.coordinator import Coordinator, Proposal, SingleProcess, make_coordinator
from smartckpt_cli.engine.observers import LocalSource
from smartckpt_cli.errors import NoCheckpointError
from smartckpt_cli.store.directory import open_store
from smartckpt_cli.trigger.policies import Decision

NO = Decision(False)
SAVE = Decision(True, "policy", score=0.9)


def _p(step: int, decision: Decision = NO, **kw: object) -> Proposal:
    args: dict[str, object] = {"wish": None, "can_save": True, "busy": False, "signal": None}
    args.update(kw)
    return Proposal(step, decision, **args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- one process


def test_single_process_is_the_trivial_coordinator(tmp_path: Path) -> None:
    coord = make_coordinator("auto", tmp_path)  # no torch.distributed world here
    assert isinstance(coord, SingleProcess) and isinstance(coord, Coordinator)
    assert (coord.rank, coord.world, coord.leads, coord.hooks_may_save) == (0, 1, True, True)
    assert coord.next_point == math.inf  # never a decision step to wait for
    assert coord.collects_garbage()
    assert coord.open(lambda: "store-id", owner=None) == "store-id"
    assert not (tmp_path / "dir.id").exists(), "one process needs no disk id"


def test_single_process_answers_at_once() -> None:
    coord = SingleProcess()
    v = coord.agree_to_save(_p(3, SAVE))
    assert v.decision is SAVE and v.signum is None and not v.skipped and not v.agreed
    v = coord.agree_to_save(_p(4, NO, wish=SAVE))
    assert v.decision is NO and v.wish is SAVE, "a pending wish stays pending"


def test_single_process_signal_waits_for_a_step_that_can_save() -> None:
    coord = SingleProcess()
    v = coord.agree_to_save(_p(5, NO, signal=signal.SIGTERM, can_save=False))
    assert v.signum is None
    v = coord.agree_to_save(_p(6, NO, signal=signal.SIGTERM))
    assert v.signum == signal.SIGTERM


def test_single_process_save_that_cannot_be_taken_becomes_a_wish_and_busy_skips() -> None:
    coord = SingleProcess()
    v = coord.agree_to_save(_p(7, SAVE, can_save=False))
    assert v.decision.save is False and v.wish is SAVE
    v = coord.agree_to_save(_p(8, SAVE, wish=SAVE, busy=True))
    assert v.decision.save is False and v.wish is None and v.skipped


def test_single_process_restore_falls_back_and_names_the_store(tmp_path: Path, isolated: None) -> None:
    model = torch.nn.Linear(4, 2)
    with sc.CheckpointManager(tmp_path / "ckpt", keep_last=5) as mgr:
        mgr.register(model=model)
        mgr.save(1, blocking=True)
        mgr.save(2, blocking=True)
    store = open_store(tmp_path / "ckpt")
    state = store.journal.read()
    order = LocalSource().order(state, include_unhealthy=False)
    assert [c.record.step for c in order] == [2, 1]
    coord = SingleProcess()

    def load(cand: object) -> object:
        rec = cand.record  # type: ignore[attr-defined]
        return coord.load(store, rec, state.store_id, skip_corrupt_l2=False, workers=1)

    (tmp_path / "ckpt" / order[0].record.manifest).unlink()  # the newest is unusable
    loaded = coord.restore(order, load, store.root)
    assert loaded is not None and loaded.record.step == 1
    (tmp_path / "ckpt" / order[1].record.manifest).unlink()
    with pytest.raises(
        NoCheckpointError, match=f"no checkpoint in {tmp_path / 'ckpt'} verifies \\(2 tried\\)"
    ):
        coord.restore(order, load, store.root)
    assert coord.restore([], load, store.root) is None


# ---------------------------------------------------------------------- two ranks

RANK = r"""
import json, math, signal, sys
from pathlib import Path
import torch.distributed as dist
from smartckpt_cli.engine.coordinator import Proposal, Ranks, make_coordinator
from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.trigger.policies import Decision

root, rank = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
NO = Decision(False)


class Owner:
    def close(self):
        pass


def p(step, decision=NO, **kw):
    args = dict(wish=None, can_save=True, busy=False, signal=None, step_seconds=0.01, quiet_step=math.inf,
                spacing=8 if rank == 0 else 3)
    args.update(kw)
    return Proposal(step, decision, **args)


def show(v):
    return [v.decision.save, v.decision.reason, v.signum, v.agreed, v.spacing, v.wish is not None]


out = {}
coord = make_coordinator("auto", root / "store")
assert isinstance(coord, Ranks)
out["who"] = [coord.rank, coord.world, coord.leads, coord.hooks_may_save, (root / "store" / "dir.id").exists()]
out["open"] = coord.open(lambda: "sid-" + str(rank), Owner())
try:
    coord.open(lambda: (_ for _ in ()).throw(OSError("journal unreadable")), Owner())
    out["open_fail"] = None
except (SmartckptError, OSError) as err:
    out["open_fail"] = [type(err).__name__, str(err)]
# step 1: rank 0's policy wants a save, rank 1's does not
out["save"] = show(coord.agree_to_save(p(1, Decision(rank == 0, "policy"))))
# step 2: SIGTERM reached rank 1 only
out["signal"] = show(coord.agree_to_save(p(2, signal=signal.SIGTERM if rank == 1 else None)))
# step 3: rank 0 wants a save, rank 1 cannot snapshot this step: nobody saves, the wish stays
v = coord.agree_to_save(p(3, Decision(rank == 0, "policy"), can_save=rank == 0))
out["blocked"] = show(v)
# step 4: the wish again, now every rank can save
out["wish"] = show(coord.agree_to_save(p(4, v.wish or NO, wish=v.wish)))
# step 5: rank 1's memory is about to run out
out["memory"] = show(coord.agree_to_save(p(5, Decision(rank == 1, "memory pressure"))))
# step 6: nothing; the next decision step is agreed by the collective itself
out["quiet"] = show(coord.agree_to_save(p(6, quiet_step=9)))
out["next"] = coord.next_point
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import os
    import sys

    root = tmp_path_factory.mktemp("ranks")
    (root / "store").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCKPT_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env.pop("WORLD_SIZE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(root), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return outs


def test_ranks_know_who_they_are_and_share_rank0s_store_id(two_ranks: list[dict]) -> None:
    r0, r1 = two_ranks
    assert r0["who"] == [0, 2, True, False, True]
    assert r1["who"] == [1, 2, False, False, True]
    assert r0["open"] == r1["open"] == "sid-0"


def test_rank0s_failure_to_open_fails_every_rank(two_ranks: list[dict]) -> None:
    r0, r1 = two_ranks
    assert r0["open_fail"] == ["OSError", "journal unreadable"]
    assert r1["open_fail"] == ["SmartckptError", "rank 0: journal unreadable"]


def test_ranks_agree_on_rank0s_save(two_ranks: list[dict]) -> None:
    r0, r1 = two_ranks
    # [save, reason, signum, agreed, spacing, wish pending]
    assert r0["save"] == [True, "policy", None, True, 8, False]
    assert r1["save"] == [True, "rank 0 trigger", None, True, 8, False]


def test_a_signal_on_one_rank_reaches_both(two_ranks: list[dict]) -> None:
    for r in two_ranks:
        assert r["signal"][2] == signal.SIGTERM
        assert r["signal"][0] is False  # the blocking save follows from the signal itself


def test_a_rank_that_cannot_save_holds_every_rank_back_and_the_wish_waits(two_ranks: list[dict]) -> None:
    r0, r1 = two_ranks
    assert r0["blocked"] == [False, "", None, True, 8, True]
    assert r1["blocked"] == [False, "", None, True, 8, False]
    assert r0["wish"][:2] == [True, "policy"] and r1["wish"][:2] == [True, "rank 0 trigger"]


def test_one_ranks_memory_alarm_makes_both_save(two_ranks: list[dict]) -> None:
    for r in two_ranks:
        assert r["memory"][:3] == [True, "memory pressure", None]


def test_both_ranks_know_the_next_decision_step(two_ranks: list[dict]) -> None:
    r0, r1 = two_ranks
    assert r0["quiet"][:4] == r1["quiet"][:4] == [False, "", None, True]
    assert r0["next"] == r1["next"]
    assert 7 <= r0["next"] <= 9  # no later than rank 0's policy needs it


# ---------------------------------------------------------------------- rank 0's answers (pure)


def test_rank0_plans_each_rank_its_own_refs_and_who_collects_garbage() -> None:
    from smartckpt_cli.engine.distributed import entry_hash
    from smartckpt_cli.engine.multirank import _plans

    w, r0, r1, r2 = (entry_hash(k, d) for k, d in (("w", "a"), ("rng", "0"), ("rng", "1"), ("rng", "2")))
    heard = [
        {"hashes": [w, r0], "dir": "n0"},
        {"hashes": [r1, w], "dir": "n0"},
        {"hashes": [w, r2], "dir": "n1"},
    ]
    plans = _plans(heard)
    assert len({p["cid"] for p in plans}) == 1 and len(plans[0]["cid"]) == 12  # one checkpoint id
    # rank 1 shares rank 0's disk: its copy of w (its entry 1) is rank 0's; rank 2 has its own disk
    assert [p["refs"] for p in plans] == [[], [(1, 0)], []]
    assert [p["gc"] for p in plans] == [True, False, True]  # the lowest rank of each disk
    # a rank that could not stage its state: every rank is told, nobody writes
    lost = _plans([heard[0], {"hashes": None, "dir": "n0"}, heard[2]])
    assert lost == [{"lost": [1]}] * 3


def test_rank0_reads_every_ranks_restore_verdict_once_for_all() -> None:
    from smartckpt_cli.engine.multirank import _restore_outcome

    assert _restore_outcome([None, None, None]) == {"failed": None, "refused": None, "bad": None}
    bad = _restore_outcome([None, ["corrupt", "blob x"], None, ["corrupt", "gone"]])
    assert bad == {"failed": None, "refused": None, "bad": "rank 1: blob x; rank 3: gone"}
    refused = _restore_outcome([["corrupt", "x"], ["refused", "shape"], ["refused", "other"]])
    assert refused["refused"] == [1, "shape"]
    failed = _restore_outcome([None, ["corrupt", "x"], ["error", "MemoryError: out"]])
    assert failed["failed"] == "rank 2: MemoryError: out"  # every rank stops with rank 2's error
